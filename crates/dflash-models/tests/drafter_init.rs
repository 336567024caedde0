//! Starting weights of a drafter: from the target's top layers, and warm starts from a saved
//! drafter (with the mismatches they must refuse).

use candle_core::{DType, Device, Tensor};
use dflash_models::drafter::{
    config_for_target, init_from_target_layers, parameter_shapes, save_drafter, warm_start_weights,
};
use dflash_models::{load_drafter, load_target, target_tensors};
use std::path::PathBuf;

fn tiny() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-llama")
}

fn same(a: &Tensor, b: &Tensor) -> bool {
    a.dims() == b.dims()
        && a.flatten_all().unwrap().to_vec1::<f32>().unwrap()
            == b.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

#[test]
fn target_layer_init_copies_the_top_layers_and_starts_fc_at_the_deepest_tap() {
    let t = load_target(&tiny(), &Device::Cpu, DType::F32).unwrap();
    let n = t.config.num_hidden_layers;
    let cfg = config_for_target(&t, 2, 4, 0);
    let tt = target_tensors(&tiny()).unwrap();
    let w = init_from_target_layers(&cfg, &tt, 3).unwrap();
    for (name, shape) in parameter_shapes(&cfg) {
        assert_eq!(w[&name].dims(), shape.as_slice(), "{name}");
    }
    for i in 0..2 {
        let j = n - 2 + i;
        for p in [
            "self_attn.q_proj.weight",
            "mlp.down_proj.weight",
            "input_layernorm.weight",
        ] {
            assert!(
                same(
                    &w[&format!("layers.{i}.{p}")],
                    &tt[&format!("model.layers.{j}.{p}")]
                ),
                "layer {i} {p} is target layer {j}'s"
            );
        }
        // a Llama target has no q/k norms: they start at 1
        let qn = w[&format!("layers.{i}.self_attn.q_norm.weight")]
            .to_vec1::<f32>()
            .unwrap();
        assert!(qn.iter().all(|&x| x == 1.0));
    }
    assert!(same(&w["norm.weight"], &tt["model.norm.weight"]));
    let h = cfg.hidden_size;
    let taps = cfg.target_layer_ids().len();
    let fc = w["fc.weight"].to_vec2::<f32>().unwrap();
    for (r, row) in fc.iter().enumerate() {
        for (c, &x) in row.iter().enumerate() {
            let want = if c == (taps - 1) * h + r { 1.0 } else { 0.0 };
            assert_eq!(x, want, "fc[{r}][{c}]");
        }
    }
    // more drafter layers than the target has is refused
    let too_deep = config_for_target(&t, n + 1, 4, 0);
    assert!(init_from_target_layers(&too_deep, &tt, 3).is_err());
}

#[test]
fn warm_start_round_trips_a_saved_drafter_and_refuses_another_shape() {
    let t = load_target(&tiny(), &Device::Cpu, DType::F32).unwrap();
    let cfg = config_for_target(&t, 2, 4, 0);
    let w = init_from_target_layers(&cfg, &target_tensors(&tiny()).unwrap(), 3).unwrap();
    let dir = tempfile::tempdir().unwrap();
    save_drafter(dir.path(), &cfg, &w, 16 << 20).unwrap();
    let back = warm_start_weights(dir.path(), &cfg).unwrap();
    assert_eq!(back.len(), w.len());
    for (k, v) in &w {
        assert!(same(v, &back[k]), "{k}");
    }
    load_drafter(dir.path(), &Device::Cpu, DType::F32).unwrap();
    let other = config_for_target(&t, 1, 4, 0);
    let err = warm_start_weights(dir.path(), &other)
        .unwrap_err()
        .to_string();
    assert!(err.contains("layers"), "{err}");
    assert!(warm_start_weights(&dir.path().join("nope"), &cfg).is_err());
}

/// A hybrid target (tiny Qwen3.5: three Gated DeltaNet layers, then one gated full-attention
/// layer) starts the drafter from its full-attention layer: the query rows without the gate rows,
/// the zero-centred norms as `1 + w`, the MLP as is; the drafter drafts against the target; a
/// drafter deeper than the target's attention layers is refused naming them.
#[test]
fn a_hybrid_target_starts_the_drafter_from_its_attention_layers() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/tiny-qwen3.5");
    let t = load_target(&dir, &Device::Cpu, DType::F32).unwrap();
    let tt = target_tensors(&dir).unwrap();
    let cfg = config_for_target(&t, 1, 4, 0);
    let w = init_from_target_layers(&cfg, &tt, 3).unwrap();
    for (name, shape) in parameter_shapes(&cfg) {
        assert_eq!(w[&name].dims(), shape.as_slice(), "{name}");
    }
    let (heads, hd) = (cfg.num_attention_heads, cfg.head_dim);
    let q = tt["model.layers.3.self_attn.q_proj.weight"].clone();
    assert_eq!(
        q.dim(0).unwrap(),
        2 * heads * hd,
        "the fixture's attention is gated"
    );
    for head in 0..heads {
        let got = w["layers.0.self_attn.q_proj.weight"]
            .narrow(0, head * hd, hd)
            .unwrap();
        let want = q.narrow(0, 2 * head * hd, hd).unwrap();
        assert!(
            same(&got, &want),
            "head {head}: its query rows, not its gate rows"
        );
    }
    for (dst, src) in [
        (
            "layers.0.self_attn.k_norm.weight",
            "model.layers.3.self_attn.k_norm.weight",
        ),
        (
            "layers.0.input_layernorm.weight",
            "model.layers.3.input_layernorm.weight",
        ),
        (
            "hidden_norm.weight",
            "model.layers.3.input_layernorm.weight",
        ),
        ("norm.weight", "model.norm.weight"),
    ] {
        assert!(
            same(&w[dst], &(&tt[src] + 1.0).unwrap()),
            "{dst} is 1 + {src}"
        );
    }
    assert!(same(
        &w["layers.0.mlp.down_proj.weight"],
        &tt["model.layers.3.mlp.down_proj.weight"]
    ));
    // the drafter from these weights drafts against the hybrid
    let tmp = tempfile::tempdir().unwrap();
    save_drafter(tmp.path(), &cfg, &w, 16 << 20).unwrap();
    let mut d = load_drafter(tmp.path(), &Device::Cpu, DType::F32).unwrap();
    d.bind_target(t.model.as_ref()).unwrap();
    // two drafter layers from one attention layer: refused, naming it
    let err = init_from_target_layers(&config_for_target(&t, 2, 4, 0), &tt, 3)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("full-attention layers") && err.contains("[3]"),
        "{err}"
    );
}
