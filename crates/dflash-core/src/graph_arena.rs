//! Where a rebuilt step graph ([`crate::graph_rebuild`], CUDA) puts the allocations its capture
//! made: one arena, places reused between allocations whose lifetimes do not overlap.
//!
//! Invariants:
//! - Lifetimes are positions in the graph's one total order: an allocation is born at its
//!   allocation node and dies at its free node (`usize::MAX`: never freed, placed by the caller).
//! - Two allocations share arena bytes only when one died before the other was born.
//! - A pointer value is mapped through the allocation live at the reading node (the driver reuses
//!   addresses between allocations of one graph).
//! - A packed-parameter list is read only as CUDA defines it (buffer pointer, buffer size, end);
//!   any other key is an error, never a guess.

/// One graph allocation: where the driver put it, for how long, and where it goes now.
#[derive(Debug, Clone)]
pub(crate) struct Allocation {
    pub dptr: u64,
    pub bytes: usize,
    /// Position (in the graph's order) of its allocation and free nodes (`usize::MAX`: never
    /// freed, an output).
    pub born: usize,
    pub dies: usize,
    pub place: u64,
}

/// Gives each allocation an arena place (first fit among places live at its birth, 256-byte
/// aligned); returns the arena's size. Outputs (never freed) are placed by the caller.
pub(crate) fn place_allocations(allocs: &mut [Allocation]) -> usize {
    const ALIGN: usize = 256;
    let mut placed: Vec<(usize, usize, usize)> = vec![]; // (offset, bytes, dies)
    let mut size = 0usize;
    for a in allocs.iter_mut().filter(|a| a.dies != usize::MAX) {
        placed.retain(|&(_, _, dies)| dies > a.born);
        placed.sort_unstable();
        let bytes = a.bytes.div_ceil(ALIGN) * ALIGN;
        let mut offset = 0usize;
        for &(o, b, _) in &placed {
            if o >= offset + bytes {
                break;
            }
            offset = offset.max(o + b);
        }
        placed.push((offset, bytes, a.dies));
        a.place = offset as u64;
        size = size.max(offset + bytes);
    }
    size
}

/// Where `value`, read by the node at position `at`, points now (`None`: not into a graph
/// allocation live there).
pub(crate) fn remap(allocs: &[Allocation], value: u64, at: usize) -> Option<u64> {
    allocs
        .iter()
        .find(|a| a.born < at && at < a.dies && value >= a.dptr && value < a.dptr + a.bytes as u64)
        .map(|a| a.place + (value - a.dptr))
}

/// Moves `*pointer`, read by the node at position `at`, to its place ([`remap`]); whether it
/// pointed into a graph allocation live there.
pub(crate) fn move_pointer(allocs: &[Allocation], pointer: &mut u64, at: usize) -> bool {
    match remap(allocs, *pointer, at) {
        Some(new) => {
            *pointer = new;
            true
        }
        None => false,
    }
}

/// The keys of a kernel launch's packed-parameter list (`extra`, CUDA's `CU_LAUNCH_PARAM_*`).
pub(crate) const LAUNCH_PARAM_END: *mut std::ffi::c_void = std::ptr::null_mut();
pub(crate) const LAUNCH_PARAM_BUFFER_POINTER: *mut std::ffi::c_void =
    std::ptr::without_provenance_mut(1);
pub(crate) const LAUNCH_PARAM_BUFFER_SIZE: *mut std::ffi::c_void =
    std::ptr::without_provenance_mut(2);

/// The packed parameter buffer and its size from a kernel node's `extra` list.
///
/// # Safety
/// `extra` must be a live `CU_LAUNCH_PARAM_END`-terminated list of a kernel node.
pub(crate) unsafe fn packed_params(
    extra: *mut *mut std::ffi::c_void,
) -> Result<(*const u8, usize), String> {
    let (mut buffer, mut size) = (std::ptr::null::<u8>(), None);
    for i in (0..32).step_by(2) {
        let key = *extra.add(i);
        if key == LAUNCH_PARAM_END {
            break;
        }
        let value = *extra.add(i + 1);
        if key == LAUNCH_PARAM_BUFFER_POINTER {
            buffer = value as *const u8;
        } else if key == LAUNCH_PARAM_BUFFER_SIZE {
            size = Some(*(value as *const usize));
        } else {
            return Err("a kernel node with an unknown packed-parameter key".into());
        }
    }
    match size {
        Some(s) if !buffer.is_null() && s > 0 => Ok((buffer, s)),
        _ => Err("a kernel node with an incomplete packed-parameter list".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(dptr: u64, bytes: usize, born: usize, dies: usize) -> Allocation {
        Allocation {
            dptr,
            bytes,
            born,
            dies,
            place: 0,
        }
    }

    #[test]
    fn places_reuse_only_after_death_and_never_overlap_live_ones() {
        let mut a = vec![
            alloc(0x1000, 100, 0, 5),
            alloc(0x2000, 300, 1, 3),
            alloc(0x3000, 200, 4, 9), // after the second died: takes its place
            alloc(0x4000, 100, 6, 8), // the first died at 5: its place
        ];
        let size = place_allocations(&mut a);
        assert_eq!(a[0].place, 0);
        assert_eq!(a[1].place, 256);
        assert_eq!(a[2].place, 256);
        assert_eq!(a[3].place, 0);
        assert_eq!(size, 768); // the second: 300 bytes take 512 at offset 256
        for (i, x) in a.iter().enumerate() {
            for y in &a[i + 1..] {
                let overlap_time = x.born < y.dies && y.born < x.dies;
                let overlap_space =
                    x.place < y.place + y.bytes as u64 && y.place < x.place + x.bytes as u64;
                assert!(!(overlap_time && overlap_space), "{x:?} and {y:?} collide");
            }
        }
    }

    #[test]
    fn packed_parameter_lists_are_read_and_bad_ones_refused() {
        let mut buffer = [7u8; 24];
        let mut size: usize = 24;
        let mut list = [
            LAUNCH_PARAM_BUFFER_POINTER,
            buffer.as_mut_ptr() as *mut std::ffi::c_void,
            LAUNCH_PARAM_BUFFER_SIZE,
            &mut size as *mut usize as *mut std::ffi::c_void,
            LAUNCH_PARAM_END,
        ];
        // SAFETY: a live, END-terminated list whose pointers outlive the calls.
        let (ptr, n) = unsafe { packed_params(list.as_mut_ptr()) }.unwrap();
        assert_eq!((ptr, n), (buffer.as_ptr(), 24));
        list[2] = std::ptr::without_provenance_mut(9); // an unknown key
        assert!(unsafe { packed_params(list.as_mut_ptr()) }.is_err());
        let mut no_size = [
            LAUNCH_PARAM_BUFFER_POINTER,
            buffer.as_mut_ptr() as *mut std::ffi::c_void,
            LAUNCH_PARAM_END,
        ];
        assert!(unsafe { packed_params(no_size.as_mut_ptr()) }.is_err());
    }

    #[test]
    fn an_address_reused_by_the_driver_maps_by_the_allocation_live_then() {
        let mut a = vec![alloc(0x1000, 64, 0, 3), alloc(0x1000, 64, 4, 7)];
        a[0].place = 0x9000;
        a[1].place = 0xa000;
        assert_eq!(remap(&a, 0x1010, 2), Some(0x9010));
        assert_eq!(remap(&a, 0x1010, 5), Some(0xa010));
        assert_eq!(remap(&a, 0x1010, 3), None); // between them: nobody's
        assert_eq!(remap(&a, 0x1040, 2), None); // one past the end
    }
}
