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
