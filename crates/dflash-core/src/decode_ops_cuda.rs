//! Launches of the decoding-step kernels (`decode_kernels.cu`, NVRTC, compiled once per process)
//! and the LM head's bf16/f16 GEMM with f32 output (cuBLAS GemmEx on candle's stream).
//!
//! Invariants: inputs are read through their contiguous offsets (anything else is an error);
//! every output element is written by exactly one thread, so outputs are allocated
//! uninitialised; everything runs on candle's stream, in order with the ops around it.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cublas::sys as cublas;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, DevicePtrMut, LaunchConfig};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CpuStorage, CudaStorage, CustomOp1, CustomOp2, DType, Device, Layout, Shape};
use candle_core::{Result, Tensor};
use std::sync::OnceLock;

/// The module: `decode_kernels.cu`, then the layer kernels of `decode_layer_kernels.cu` (which
/// use the former's helpers).
const SOURCE: &str = concat!(
    include_str!("decode_kernels.cu"),
    include_str!("decode_layer_kernels.cu")
);
pub(crate) const MODULE: &str = "dflash_decode_kernels";
pub(crate) const TPB: u32 = 1024;

pub(crate) fn ptx() -> Result<&'static str> {
    static PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
    PTX.get_or_init(|| {
        candle_core::cuda_backend::cudarc::nvrtc::compile_ptx_with_opts(
            crate::pdl::with_prelude(SOURCE),
            crate::pdl::nvrtc_options(None),
        )
        .map(|p| p.to_src())
        .map_err(|e| format!("decode kernels: NVRTC failed: {e:?}"))
    })
    .as_deref()
    .map_err(|e| candle_core::Error::Msg(e.clone()))
}

/// The contiguous elements of an input (anything strided is an error, never a misread).
pub(crate) fn slice_of<
    'a,
    T: candle_core::cuda_backend::CudaDType + candle_core::cuda_backend::cudarc::driver::DeviceRepr,
>(
    s: &'a CudaStorage,
    l: &Layout,
    what: &str,
) -> Result<candle_core::cuda_backend::cudarc::driver::CudaView<'a, T>> {
    let (a, b) = l
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{what}: strided input")))?;
    Ok(s.as_cuda_slice::<T>()?.slice(a..b))
}

pub(crate) fn not_on_cpu<T>(name: &str) -> Result<T> {
    candle_core::bail!("{name}: the CUDA op was called on a CPU tensor")
}

struct ArgmaxRows;
impl CustomOp1 for ArgmaxRows {
    fn name(&self) -> &'static str {
        "argmax-rows"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        not_on_cpu(self.name())
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let (rows, vocab) = l.shape().dims2()?;
        let dev = s.device().clone();
        let x = slice_of::<f32>(s, l, "decode kernels")?;
        // SAFETY: the kernel writes one id per row.
        let out = unsafe { dev.alloc::<u32>(rows)? };
        let f = dev.get_or_load_custom_func("argmax_rows", MODULE, ptx()?)?;
        crate::pdl::mark(&f);
        let mut b = f.builder();
        let v = vocab as i32;
        b.arg(&x).arg(&v).arg(&out);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (TPB, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: arguments match the kernel's signature; one block per row.
        unsafe { b.launch(cfg) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(rows)))
    }
}

/// Ids of each row's maximum (lowest id on ties; `u32::MAX` where no value wins).
pub(crate) fn argmax_rows(logits: &Tensor) -> crate::Result<Vec<u32>> {
    Ok(logits.apply_op1_no_bwd(&ArgmaxRows)?.to_vec1()?)
}

struct TopKRows(usize);
impl CustomOp1 for TopKRows {
    fn name(&self) -> &'static str {
        "top-k-rows"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        not_on_cpu(self.name())
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let (rows, vocab) = l.shape().dims2()?;
        let k = self.0;
        let dev = s.device().clone();
        let x = slice_of::<f32>(s, l, "decode kernels")?;
        // SAFETY: the kernel writes k values and k ids per row (values as f32 bits).
        let mut out = unsafe { dev.alloc::<u32>(rows * 2 * k)? };
        let f = dev.get_or_load_custom_func("topk_rows", MODULE, ptx()?)?;
        {
            let (mut vals, mut ids) = out.split_at_mut(rows * k);
            crate::pdl::mark(&f);
            let mut b = f.builder();
            let (v, kk) = (vocab as i32, k as i32);
            b.arg(&x).arg(&v).arg(&kk).arg(&mut vals).arg(&mut ids);
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (TPB, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: arguments match the kernel's signature (the value plane is written as
            // f32 through a u32 buffer of the same size); one block per row.
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from((2, rows, k)),
        ))
    }
}

/// [`TopKRows`] with each row spread over several blocks (`topk_split_partial`, then
/// `topk_split_merge`): the same (value, id) set; log-probs differ from the one-block kernel's
/// only by the order of the softmax sum. Output `[2, rows, k]` as [`TopKRows`], best first.
struct TopKSplit {
    k: usize,
    splits: usize,
    len: usize,
}
impl CustomOp1 for TopKSplit {
    fn name(&self) -> &'static str {
        "top-k-split"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        not_on_cpu(self.name())
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let (rows, vocab) = l.shape().dims2()?;
        let (k, splits) = (self.k, self.splits);
        let dev = s.device().clone();
        let x = slice_of::<f32>(s, l, "decode kernels")?;
        // SAFETY: the partial kernel writes k candidates and 2 stats per (row, split); the merge
        // writes k values and k ids per row.
        let mut cand_val = unsafe { dev.alloc::<f32>(rows * splits * k)? };
        let mut cand_idx = unsafe { dev.alloc::<u32>(rows * splits * k)? };
        let mut stats = unsafe { dev.alloc::<f32>(rows * splits * 2)? };
        let mut out = unsafe { dev.alloc::<u32>(rows * 2 * k)? };
        let (v, len, kk, sp) = (vocab as i32, self.len as i32, k as i32, splits as i32);
        let f = dev.get_or_load_custom_func("topk_split_partial", MODULE, ptx()?)?;
        crate::pdl::mark(&f);
        let mut b = f.builder();
        b.arg(&x).arg(&v).arg(&len).arg(&kk);
        b.arg(&mut cand_val).arg(&mut cand_idx).arg(&mut stats);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, splits as u32, 1),
            block_dim: (TPB, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: arguments match the kernel's signature; the plan keeps every slice ≥ k long.
        unsafe { b.launch(cfg) }.w()?;
        let g = dev.get_or_load_custom_func("topk_split_merge", MODULE, ptx()?)?;
        crate::pdl::mark(&g);
        {
            let (mut vals, mut ids) = out.split_at_mut(rows * k);
            let mut b = g.builder();
            b.arg(&cand_val)
                .arg(&cand_idx)
                .arg(&stats)
                .arg(&sp)
                .arg(&kk);
            b.arg(&mut vals).arg(&mut ids);
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: arguments match the kernel's signature (values as f32 bits in the u32
            // plane); splits · k ≤ the kernel's candidate capacity (the plan's bound).
            unsafe { b.launch(cfg) }.w()?;
        }
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from((2, rows, k)),
        ))
    }
}

/// Each row's `k` largest log-probabilities (value, id), unsorted; with `split`, rows are spread
/// over several blocks where the plan allows ([`TopKSplit`]).
pub(crate) fn top_k_rows(
    logits: &Tensor,
    k: usize,
    split: bool,
) -> crate::Result<Vec<Vec<(f32, u32)>>> {
    let (rows, vocab) = logits.dims2()?;
    let plan = if split {
        crate::decode_ops::topk_split_plan(rows, vocab, k)
    } else {
        None
    };
    let out = match plan {
        Some((splits, len)) => logits.apply_op1_no_bwd(&TopKSplit { k, splits, len })?,
        None => logits.apply_op1_no_bwd(&TopKRows(k))?,
    };
    let out: Vec<Vec<Vec<u32>>> = out.to_vec3()?;
    Ok(out[0]
        .iter()
        .zip(&out[1])
        .map(|(vals, ids)| {
            vals.iter()
                .zip(ids)
                .map(|(&v, &i)| (f32::from_bits(v), i))
                .collect()
        })
        .collect())
}

struct VisibilityMask {
    past: usize,
    chain: bool,
}
impl CustomOp1 for VisibilityMask {
    fn name(&self) -> &'static str {
        "visibility-mask"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        not_on_cpu(self.name())
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let n = l.shape().dims1()?;
        let kv = self.past + n;
        let dev = s.device().clone();
        let parents = slice_of::<i64>(s, l, "visibility mask")?;
        // SAFETY: one thread per (query, key) writes every element.
        let out = unsafe { dev.alloc::<f32>(n * kv)? };
        let f = dev.get_or_load_custom_func("visibility_mask", MODULE, ptx()?)?;
        crate::pdl::mark(&f);
        let mut bld = f.builder();
        let (nn, past, chain) = (n as i32, self.past as i32, self.chain as i32);
        bld.arg(&parents).arg(&nn).arg(&past).arg(&chain).arg(&out);
        let cfg = LaunchConfig {
            grid_dim: (kv.div_ceil(256) as u32, n as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: arguments match the kernel's signature; the grid covers [n, kv].
        unsafe { bld.launch(cfg) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((n, kv))))
    }
}

/// The additive mask of [`crate::decode_ops::visibility_mask`], built on the device from the
/// `n` parent indices (the only upload).
pub(crate) fn visibility_mask(parents: &[i64], past: usize, dev: &Device) -> crate::Result<Tensor> {
    let chain = parents.iter().enumerate().all(|(i, &p)| p == i as i64 - 1);
    let p = Tensor::from_slice(parents, parents.len(), dev)?;
    Ok(p.apply_op1_no_bwd(&VisibilityMask { past, chain })?)
}

struct MatmulTF32;
impl CustomOp2 for MatmulTF32 {
    fn name(&self) -> &'static str {
        "matmul-t-f32-out"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        not_on_cpu(self.name())
    }
    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xl: &Layout,
        ws: &CudaStorage,
        wl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (n, k) = xl.shape().dims2()?;
        let (v, _) = wl.shape().dims2()?;
        let dev = xs.device().clone();
        let stream = dev.cuda_stream();
        let ((xa, xb), (wa, wb)) = match (xl.contiguous_offsets(), wl.contiguous_offsets()) {
            (Some(x), Some(w)) => (x, w),
            _ => candle_core::bail!("matmul_t_f32: non-contiguous operand"),
        };
        let ty = match xs.dtype() {
            DType::BF16 => cublas::cudaDataType_t::CUDA_R_16BF,
            DType::F16 => cublas::cudaDataType_t::CUDA_R_16F,
            d => candle_core::bail!("matmul_t_f32: {d:?} operands"),
        };
        // SAFETY: cuBLAS writes all n·v outputs (beta = 0).
        let mut out = unsafe { dev.alloc::<f32>(n * v)? };
        let blas = dev.cublas_handle();
        let (alpha, beta) = (1.0f32, 0.0f32);
        macro_rules! ptrs {
            ($t:ty) => {{
                let x = xs.as_cuda_slice::<$t>()?.slice(xa..xb);
                let w = ws.as_cuda_slice::<$t>()?.slice(wa..wb);
                let (xp, _gx) = x.device_ptr(&stream);
                let (wp, _gw) = w.device_ptr(&stream);
                let (op, _go) = out.device_ptr_mut(&stream);
                // Column-major: out (v × n, ld v) = wᵀ (v × k; w is k × v, ld k) · x (k × n, ld k).
                // SAFETY: pointers are live device buffers of the stated sizes on this stream.
                unsafe {
                    candle_core::cuda_backend::cudarc::cublas::result::gemm_ex(
                        *blas.handle(),
                        cublas::cublasOperation_t::CUBLAS_OP_T,
                        cublas::cublasOperation_t::CUBLAS_OP_N,
                        v as i32,
                        n as i32,
                        k as i32,
                        &alpha as *const f32 as *const _,
                        wp as *const _,
                        ty,
                        k as i32,
                        xp as *const _,
                        ty,
                        k as i32,
                        &beta as *const f32 as *const _,
                        op as *mut _,
                        cublas::cudaDataType_t::CUDA_R_32F,
                        v as i32,
                        cublas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        cublas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                    )
                }
                .map_err(|e| candle_core::Error::Msg(format!("matmul_t_f32: {e:?}")))?;
            }};
        }
        match xs.dtype() {
            DType::BF16 => ptrs!(half::bf16),
            _ => ptrs!(half::f16),
        }
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((n, v))))
    }
}

pub(crate) fn matmul_t_f32(x: &Tensor, w: &Tensor) -> crate::Result<Tensor> {
    Ok(x.apply_op2_no_bwd(w, &MatmulTF32)?)
}

fn sfx(dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        d => candle_core::bail!("decode kernels: {d:?} not supported"),
    }
}

/// Scores `[b, rows_per_b, kv]` (contiguous) and an optional additive f32 mask `[q_len, kv]`
/// (shared) or `[b, q_len, kv]`.
struct SoftmaxScaled {
    q_len: usize,
    scale: f32,
    mask_bstride: usize,
}

impl SoftmaxScaled {
    #[allow(clippy::too_many_arguments)]
    fn launch<
        T: candle_core::cuda_backend::CudaDType
            + candle_core::cuda_backend::cudarc::driver::DeviceRepr,
    >(
        &self,
        s: &CudaStorage,
        l: &Layout,
        mask: Option<(&CudaStorage, &Layout)>,
    ) -> Result<(CudaStorage, Shape)> {
        let (b, rows_per_b, kv) = l.shape().dims3()?;
        let dev = s.device().clone();
        let sv = slice_of::<T>(s, l, "softmax_scaled")?;
        let total = b * rows_per_b;
        // SAFETY: one warp per row writes every element of its row.
        let out = unsafe { dev.alloc::<T>(total * kv)? };
        let f = dev.get_or_load_custom_func(
            &format!("softmax_scaled_{}", sfx(s.dtype())?),
            MODULE,
            ptx()?,
        )?;
        let mv = match mask {
            Some((ms, ml)) => Some(slice_of::<f32>(ms, ml, "softmax_scaled mask")?),
            None => None,
        };
        crate::pdl::mark(&f);
        let mut bld = f.builder();
        let ints = [total, rows_per_b, self.q_len, kv].map(|x| x as i32);
        let (bstride, has) = (self.mask_bstride as i64, mask.is_some() as i32);
        bld.arg(&sv);
        match &mv {
            Some(m) => bld.arg(m),
            // never read without a mask (has_mask 0): the scores' pointer fills the slot, so no
            // placeholder is allocated per call
            None => bld.arg(&sv),
        };
        for x in &ints {
            bld.arg(x);
        }
        bld.arg(&bstride).arg(&has).arg(&self.scale).arg(&out);
        let cfg = LaunchConfig {
            grid_dim: (total.div_ceil(4) as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: arguments match the kernel's signature; 4 rows (warps) per block.
        unsafe { bld.launch(cfg) }.w()?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev), l.shape().clone()))
    }
}

impl CustomOp1 for SoftmaxScaled {
    fn name(&self) -> &'static str {
        "softmax-scaled"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        not_on_cpu("softmax-scaled")
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        match s.dtype() {
            DType::BF16 => self.launch::<half::bf16>(s, l, None),
            _ => self.launch::<f32>(s, l, None),
        }
    }
}

impl CustomOp2 for SoftmaxScaled {
    fn name(&self) -> &'static str {
        "softmax-scaled-masked"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        not_on_cpu("softmax-scaled")
    }
    fn cuda_fwd(
        &self,
        s: &CudaStorage,
        l: &Layout,
        m: &CudaStorage,
        ml: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        match s.dtype() {
            DType::BF16 => self.launch::<half::bf16>(s, l, Some((m, ml))),
            _ => self.launch::<f32>(s, l, Some((m, ml))),
        }
    }
}

/// `softmax(scale·scores + mask)` per row of `[b, rows_per_b, kv]` scores (f32 or bf16; the
/// result has their dtype). `mask`: f32 `[q_len, kv]` or `[b, q_len, kv]`.
pub(crate) fn softmax_scaled(
    scores: &Tensor,
    mask: Option<&Tensor>,
    q_len: usize,
    scale: f32,
) -> crate::Result<Tensor> {
    let s = scores.contiguous()?;
    Ok(match mask {
        None => s.apply_op1_no_bwd(&SoftmaxScaled {
            q_len,
            scale,
            mask_bstride: 0,
        })?,
        Some(m) => {
            let kv = m.dim(candle_core::D::Minus1)?;
            let op = SoftmaxScaled {
                q_len,
                scale,
                mask_bstride: if m.rank() == 3 { q_len * kv } else { 0 },
            };
            s.apply_op2_no_bwd(&m.to_dtype(DType::F32)?.contiguous()?, &op)?
        }
    })
}

struct SiluMul;
impl CustomOp1 for SiluMul {
    fn name(&self) -> &'static str {
        "silu-mul"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        not_on_cpu(self.name())
    }
    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        fn go<
            T: candle_core::cuda_backend::CudaDType
                + candle_core::cuda_backend::cudarc::driver::DeviceRepr,
        >(
            s: &CudaStorage,
            l: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let dims = l.shape().dims();
            let two = *dims.last().expect("rank checked by the caller");
            let (inter, rows) = (two / 2, l.shape().elem_count() / two);
            let dev = s.device().clone();
            let x = slice_of::<T>(s, l, "silu_mul")?;
            // SAFETY: one thread per output element.
            let out = unsafe { dev.alloc::<T>(rows * inter)? };
            let f = dev.get_or_load_custom_func(
                &format!("silu_mul_{}", sfx(s.dtype())?),
                MODULE,
                ptx()?,
            )?;
            crate::pdl::mark(&f);
            let mut bld = f.builder();
            let (r, i) = (rows as i32, inter as i32);
            bld.arg(&x).arg(&r).arg(&i).arg(&out);
            let cfg = LaunchConfig {
                grid_dim: ((rows * inter).div_ceil(256) as u32, 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: arguments match the kernel's signature; the grid covers every output.
            unsafe { bld.launch(cfg) }.w()?;
            let mut shape = dims.to_vec();
            *shape.last_mut().expect("rank ≥ 1") = inter;
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(shape)))
        }
        match s.dtype() {
            DType::BF16 => go::<half::bf16>(s, l),
            _ => go::<f32>(s, l),
        }
    }
}

/// `silu(gate) · up` for `x = [gate | up]` along the last dimension.
pub(crate) fn silu_mul(x: &Tensor) -> crate::Result<Tensor> {
    Ok(x.contiguous()?.apply_op1_no_bwd(&SiluMul)?)
}

/// Inputs: `y` `[n, (h + 2·kv)·hd]`, `cs` = cos then sin `[2·n, rot/2]`, `norms` = q_norm then
/// k_norm weights `[2, hd]` (ignored without `has_norm`). Output `[h + 2·kv, n, hd]`.
struct QkvHeads {
    h: usize,
    kv: usize,
    hd: usize,
    rot: usize,
    has_norm: bool,
    eps: f32,
}

impl QkvHeads {
    fn go<
        T: candle_core::cuda_backend::CudaDType
            + candle_core::cuda_backend::cudarc::driver::DeviceRepr,
    >(
        &self,
        ys: &CudaStorage,
        yl: &Layout,
        css: &CudaStorage,
        csl: &Layout,
        ns: &CudaStorage,
        nl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let n = yl.shape().dims2()?.0;
        let heads = self.h + 2 * self.kv;
        let dev = ys.device().clone();
        let y = slice_of::<T>(ys, yl, "qkv_heads")?;
        let cs = slice_of::<T>(css, csl, "qkv_heads")?;
        let half = self.rot / 2;
        let (cos, sin) = (cs.slice(0..n * half), cs.slice(n * half..2 * n * half));
        let norms = slice_of::<T>(ns, nl, "qkv_heads")?;
        let (qw, kw) = (norms.slice(0..self.hd), norms.slice(self.hd..2 * self.hd));
        // SAFETY: one thread per (row, head, channel) writes every element.
        let out = unsafe { dev.alloc::<T>(heads * n * self.hd)? };
        let f = dev.get_or_load_custom_func(
            &format!("qkv_heads_{}", sfx(ys.dtype())?),
            MODULE,
            ptx()?,
        )?;
        crate::pdl::mark(&f);
        let mut b = f.builder();
        b.arg(&y).arg(&cos).arg(&sin).arg(&qw).arg(&kw);
        let ints = [
            n,
            self.h,
            self.kv,
            self.hd,
            self.rot,
            self.has_norm as usize,
        ]
        .map(|x| x as i32);
        for x in &ints {
            b.arg(x);
        }
        b.arg(&self.eps).arg(&out);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, heads as u32, 1),
            block_dim: (self.hd as u32, 1, 1),
            shared_mem_bytes: ((self.hd + 33) * 4) as u32,
        };
        // SAFETY: arguments match the kernel's signature; one block per (row, head).
        unsafe { b.launch(cfg) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from((heads, n, self.hd)),
        ))
    }
}

impl candle_core::CustomOp3 for QkvHeads {
    fn name(&self) -> &'static str {
        "qkv-heads"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        not_on_cpu("qkv-heads")
    }
    fn cuda_fwd(
        &self,
        y: &CudaStorage,
        yl: &Layout,
        cs: &CudaStorage,
        csl: &Layout,
        n: &CudaStorage,
        nl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        match y.dtype() {
            DType::BF16 => self.go::<half::bf16>(y, yl, cs, csl, n, nl),
            _ => self.go::<f32>(y, yl, cs, csl, n, nl),
        }
    }
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn qkv_heads(
    y: &Tensor,
    cos_sin: &Tensor,
    norms: &Tensor,
    h: usize,
    kv: usize,
    hd: usize,
    rot: usize,
    has_norm: bool,
    eps: f32,
) -> crate::Result<Tensor> {
    let op = QkvHeads {
        h,
        kv,
        hd,
        rot,
        has_norm,
        eps,
    };
    Ok(y.contiguous()?
        .apply_op3_no_bwd(&cos_sin.contiguous()?, &norms.contiguous()?, &op)?)
}

struct AddRmsNorm {
    eps: f32,
}

impl candle_core::CustomOp3 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "add-rms-norm"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        not_on_cpu("add-rms-norm")
    }
    fn cuda_fwd(
        &self,
        xs: &CudaStorage,
        xl: &Layout,
        ds: &CudaStorage,
        dl: &Layout,
        ws: &CudaStorage,
        wl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        fn go<
            T: candle_core::cuda_backend::CudaDType
                + candle_core::cuda_backend::cudarc::driver::DeviceRepr,
            Wt: candle_core::cuda_backend::CudaDType
                + candle_core::cuda_backend::cudarc::driver::DeviceRepr,
        >(
            (kernel, eps): (&str, f32),
            xs: &CudaStorage,
            xl: &Layout,
            ds: &CudaStorage,
            dl: &Layout,
            ws: &CudaStorage,
            wl: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let width = *xl
                .shape()
                .dims()
                .last()
                .expect("rank checked by the caller");
            let rows = xl.shape().elem_count() / width;
            let dev = xs.device().clone();
            let (x, d, w) = (
                slice_of::<T>(xs, xl, "add_rms_norm")?,
                slice_of::<T>(ds, dl, "add_rms_norm")?,
                slice_of::<Wt>(ws, wl, "add_rms_norm")?,
            );
            // SAFETY: each row's block writes its sum and its normed row.
            let out = unsafe { dev.alloc::<T>(2 * rows * width)? };
            let f = dev.get_or_load_custom_func(kernel, MODULE, ptx()?)?;
            crate::pdl::mark(&f);
            let mut b = f.builder();
            let (r, wd) = (rows as i32, width as i32);
            b.arg(&x)
                .arg(&d)
                .arg(&w)
                .arg(&r)
                .arg(&wd)
                .arg(&eps)
                .arg(&out);
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (width.clamp(32, 1024).div_ceil(32) as u32 * 32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: arguments match the kernel's signature; one block per row.
            unsafe { b.launch(cfg) }.w()?;
            let mut shape = vec![2];
            shape.extend_from_slice(xl.shape().dims());
            Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(shape)))
        }
        use half::bf16;
        match (xs.dtype(), ws.dtype()) {
            (DType::BF16, DType::BF16) => {
                go::<bf16, bf16>(("add_rms_norm_bf16", self.eps), xs, xl, ds, dl, ws, wl)
            }
            (DType::BF16, DType::F32) => {
                go::<bf16, f32>(("add_rms_norm_bf16_wf32", self.eps), xs, xl, ds, dl, ws, wl)
            }
            (DType::F32, DType::F32) => {
                go::<f32, f32>(("add_rms_norm_f32", self.eps), xs, xl, ds, dl, ws, wl)
            }
            (x, w) => Err(candle_core::Error::Msg(format!(
                "add-rms-norm: {x:?} rows with a {w:?} weight"
            ))),
        }
    }
}

/// `[x + d ; rms_norm(x + d)·w]` stacked on a new leading dimension of 2.
pub(crate) fn add_rms_norm(x: &Tensor, d: &Tensor, w: &Tensor, eps: f32) -> crate::Result<Tensor> {
    Ok(x.contiguous()?
        .apply_op3_no_bwd(&d.contiguous()?, &w.contiguous()?, &AddRmsNorm { eps })?)
}
