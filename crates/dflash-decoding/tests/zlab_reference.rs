//! Parity with z-lab's reference implementation (PyPI dflash 0.1.0, run by scripts/zlab_reference.py
//! on the same tiny target and a drafter written by `dflash draft init`): drafter logits for a fixed
//! context and block (f32, ≤ 1e-4) and the greedy spec_generate token sequence (identical).

mod support;
use candle_core::{DType, Device, Tensor};
use dflash_decoding::{
    generate_speculative, DFlashRunner, GenerateConfig, SamplingConfig, SpecMode,
};
use dflash_models::{load_drafter, ForwardRequest, LogitRows};
use support::*;

#[test]
fn matches_zlab_reference() {
    let path = fixtures().join("zlab/reference.safetensors");
    assert!(
        path.is_file(),
        "{} is missing (made by scripts/zlab_reference.py on the GPU machine; it is committed)",
        path.display()
    );
    let r = candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let ids = |t: &Tensor| -> Vec<u32> {
        t.to_dtype(DType::I64)
            .unwrap()
            .to_vec1::<i64>()
            .unwrap()
            .into_iter()
            .map(|x| x as u32)
            .collect()
    };
    let target = tiny("tiny-qwen3");
    let mut drafter =
        load_drafter(&fixtures().join("zlab/drafter"), &Device::Cpu, DType::F32).unwrap();
    drafter.bind_target(target.model.as_ref()).unwrap();
    let prompt = ids(&r["prompt"]);
    let bonus = ids(&r["bonus"])[0];
    let m = target.model.as_ref();
    let mut cache = m.new_cache(prompt.len()).unwrap();
    let pos: Vec<u32> = (0..prompt.len() as u32).collect();
    let req = ForwardRequest {
        tokens: &prompt,
        positions: &pos,
        mask: dflash_core::AttentionMask::Causal,
        taps: drafter.target_layers(),
        logits: LogitRows::None,
    };
    let ctx = Tensor::cat(&m.forward(&req, &mut cache).unwrap().taps, 1).unwrap();
    let mut dcache = drafter.new_cache(64);
    let logits = drafter
        .draft(m, &mut dcache, &ctx, bonus, prompt.len())
        .unwrap();
    let want = &r["draft_logits"];
    let err = (logits - want)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(err <= 1e-4, "drafter logits differ from z-lab's by {err}");
    let cfg = GenerateConfig {
        cancel: None,
        max_new_tokens: 40,
        stop_tokens: vec![],
        sampling: SamplingConfig::greedy(),
    };
    let mut runner = DFlashRunner::new(&drafter);
    let g =
        generate_speculative(m, &mut runner, &prompt, &cfg, SpecMode::DFlash, &mut |_| {}).unwrap();
    assert_eq!(
        g.tokens,
        ids(&r["spec_ids"]),
        "spec_generate token sequence"
    );
}
