//! Atomic file writes: the bytes go to a temporary file in the destination's directory
//! (`tempfile`), which is then renamed over the destination, so a reader — or a crash — never
//! sees a half-written file, and a failed write leaves no temporary file behind.

use std::io::Write;
use std::path::Path;

/// Writes `bytes` to `path` atomically.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    write_atomic_with(path, |tmp: &Path| {
        let mut f = std::fs::OpenOptions::new().write(true).open(tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    })
}

/// Lets `fill` write the file at a temporary path next to `path` (a writer that takes a path,
/// such as safetensors'), then renames it to `path`; on any error the temporary file is removed.
pub fn write_atomic_with(
    path: &Path,
    fill: impl FnOnce(&Path) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let tmp = tempfile::Builder::new()
        .prefix(".dflash-")
        .suffix(".tmp")
        .tempfile_in(dir)?;
    fill(tmp.path())?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_replace_whole_files_and_failures_leave_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.json");
        write_atomic(&p, b"first, longer").unwrap();
        write_atomic(&p, b"second").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"second");
        let err = write_atomic_with(&dir.path().join("b.json"), |_| {
            Err(std::io::Error::other("planted"))
        });
        assert!(err.is_err());
        let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
        assert_eq!(names.len(), 1, "only a.json is left");
        assert!(write_atomic(&dir.path().join("missing/c.json"), b"x").is_err());
    }
}
