//! The conventions scan's variants: the declared setting and each alternative it measures (see
//! the parent module's invariants for what a variant may change).

use dflash_models::drafter::{BlockConvention, LayerAttention};
use serde::Serialize;

/// What the drafter is fed in one variant.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Variant {
    pub name: String,
    /// The tap layers, in concatenation order.
    pub target_layer_ids: Vec<usize>,
    /// The target's final RMSNorm applied to the last tap (by the drafter; as declared but in
    /// the final-norm variant).
    pub final_norm_on_last_tap: bool,
    /// Every tap shifted by this many layers from the declared ones.
    pub shift: i64,
    /// Added to every block slot's position (slot `j` at `anchor + j + offset`; the declared
    /// offset but in the position variants).
    pub position_offset: i64,
    /// Slot 0 holds the mask token instead of the anchor's token (as declared but in the slot-0
    /// variant).
    pub anchor_slot_masked: bool,
    /// The drafter's RoPE replaced by the target's (base θ here; scaling too).
    pub target_rope_theta: Option<f64>,
    /// Another mask token in the block's slots than the declared one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mask_token_id: Option<u32>,
    /// Every drafter layer's attention replaced by this one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub attention: Option<Attention>,
    /// What the variant changes.
    pub alteration: Alteration,
}

/// A drafter layer's attention in a variant (see `LayerAttention`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Attention {
    /// Block queries see only block keys at or before their own position.
    pub causal: bool,
    /// Keys visible only within this many positions (`None`: full attention).
    pub window: Option<usize>,
}

impl From<Attention> for LayerAttention {
    fn from(a: Attention) -> LayerAttention {
        LayerAttention {
            causal: a.causal,
            window: a.window,
        }
    }
}

impl Variant {
    /// A variant equal to the declared setting (taps `declared`, block layout `conv`) but for its
    /// name and kind; the callers set the field the alteration changes.
    fn base(
        name: impl Into<String>,
        declared: &[usize],
        conv: BlockConvention,
        final_norm: bool,
        alteration: Alteration,
    ) -> Variant {
        Variant {
            name: name.into(),
            target_layer_ids: declared.to_vec(),
            final_norm_on_last_tap: final_norm,
            shift: 0,
            position_offset: conv.position_offset,
            anchor_slot_masked: conv.anchor_slot_masked,
            target_rope_theta: None,
            mask_token_id: None,
            attention: None,
            alteration,
        }
    }

    pub(super) fn convention(&self) -> BlockConvention {
        BlockConvention {
            position_offset: self.position_offset,
            anchor_slot_masked: self.anchor_slot_masked,
        }
    }

    /// Whether the variant needs another drafter than the declared one (final norm on the last
    /// tap, RoPE, mask token, attention).
    pub(super) fn alters_drafter(&self) -> bool {
        self.alteration == Alteration::FinalNorm
            || self.target_rope_theta.is_some()
            || self.mask_token_id.is_some()
            || self.attention.is_some()
    }
}

/// What a [`Variant`] changes from the declared setting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Alteration {
    Declared,
    /// Every tap moved by [`Variant::shift`] layers.
    Shift,
    /// The target's final RMSNorm on the last tap the other way round from the declared
    /// `final_norm_on_last_tap`.
    FinalNorm,
    /// The last tap moved to the target's last layer (the fc fed the target's last layer).
    LastLayer,
    /// The last tap, declared on the target's last layer, moved to the default taps' last layer
    /// (the fc not fed the target's last layer).
    NotLastLayer,
    /// The z-lab default taps for the target's depth and the declared tap count (a config saved
    /// with other layers than the drafter was trained on).
    DefaultLayout,
    /// Block positions moved by one from the declared ones (to [`Variant::position_offset`]).
    Positions,
    /// Slot 0 the other way round from the declared layout (the mask token instead of the
    /// anchor's, or back).
    AnchorSlot,
    /// The target's RoPE (θ and scaling) instead of the drafter's declared one.
    TargetRope,
    /// Another mask token ([`Variant::mask_token_id`]).
    MaskToken,
    /// Every layer's attention full, or windowed ([`Variant::attention`]).
    Attention,
}

/// The declared setting (first) and each applicable alternative. `conv`: the block layout the
/// drafter declares. `final_norm`: when the target has a final norm, whether the drafter
/// declares it on its last tap (adds the variant the other way round). `target_rope`: the
/// target's RoPE θ when it differs from the drafter's declared RoPE (θ or scaling), which adds
/// the target-RoPE variant.
pub fn variants(
    declared: &[usize],
    conv: BlockConvention,
    num_layers: usize,
    final_norm: Option<bool>,
    target_rope: Option<f64>,
) -> Vec<Variant> {
    let declared_norm = final_norm.unwrap_or(false);
    let base =
        |name: String, alteration| Variant::base(name, declared, conv, declared_norm, alteration);
    let mut out = vec![base("declared".into(), Alteration::Declared)];
    for shift in [-1i64, 1] {
        let moved: Option<Vec<usize>> = declared
            .iter()
            .map(|&l| {
                let m = l as i64 + shift;
                (0..num_layers as i64).contains(&m).then_some(m as usize)
            })
            .collect();
        if let Some(layers) = moved {
            out.push(Variant {
                target_layer_ids: layers,
                shift,
                ..base(format!("taps {shift:+}"), Alteration::Shift)
            });
        }
    }
    if let (Some(on), false) = (final_norm, declared.is_empty()) {
        let name = if on {
            "no final norm on last tap"
        } else {
            "final norm on last tap"
        };
        out.push(Variant {
            final_norm_on_last_tap: !on,
            ..base(name.into(), Alteration::FinalNorm)
        });
    }
    // taps-only alternatives not already in the list
    let mut push_new = |name: &str, layers: Vec<usize>, alteration: Alteration| {
        if !out
            .iter()
            .any(|v| v.target_layer_ids == layers && v.alteration != Alteration::FinalNorm)
        {
            out.push(Variant {
                target_layer_ids: layers,
                ..base(name.into(), alteration)
            });
        }
    };
    if let Some((&l, rest)) = declared.split_last() {
        let last = num_layers.saturating_sub(1);
        if l != last && num_layers > 0 {
            let mut layers = rest.to_vec();
            layers.push(last);
            push_new("last tap on last layer", layers, Alteration::LastLayer);
        }
        let default = dflash_models::drafter::default_target_layers(num_layers, declared.len());
        if default.iter().all(|&x| x < num_layers) {
            if l == last && num_layers > 0 {
                if let Some(&d) = default.last() {
                    let mut layers = rest.to_vec();
                    layers.push(d);
                    // the same list as the default taps is measured once, as the default taps
                    if layers != default {
                        push_new("last tap off last layer", layers, Alteration::NotLastLayer);
                    }
                }
            }
            push_new("default taps", default, Alteration::DefaultLayout);
        }
    }
    // the block's layout: positions off by one from the declared ones, slot 0 the other way
    for delta in [-1i64, 1] {
        out.push(Variant {
            position_offset: conv.position_offset + delta,
            ..base(format!("positions {delta:+}"), Alteration::Positions)
        });
    }
    let slot = if conv.anchor_slot_masked {
        "slot 0 anchor token"
    } else {
        "slot 0 masked"
    };
    out.push(Variant {
        anchor_slot_masked: !conv.anchor_slot_masked,
        ..base(slot.into(), Alteration::AnchorSlot)
    });
    if let Some(theta) = target_rope {
        out.push(Variant {
            target_rope_theta: Some(theta),
            ..base(
                format!("target's RoPE (theta {theta})"),
                Alteration::TargetRope,
            )
        });
    }
    out
}

/// At most this many mask-token alternatives are measured (each costs a full replay, ~9 s of the
/// shipped pair's default diagnosis on 2 CPU cores, which must stay within 2 minutes).
pub const MAX_MASK_VARIANTS: usize = 1;

/// The drafter's own alternatives of the `declared` variant (the first of [`variants`]): the mask token (each of `mask_candidates`,
/// labelled, that is not `declared_mask`, the first [`MAX_MASK_VARIANTS`] distinct ones), and
/// the layers' attention: every layer full when any declared layer is windowed or causal, every
/// layer windowed (causal, as z-lab's sliding layers are) when all are full and the config gives
/// a `sliding_window`.
pub fn drafter_variants(
    declared: &Variant,
    declared_mask: u32,
    mask_candidates: &[(String, u32)],
    layers: &[LayerAttention],
    sliding_window: Option<usize>,
) -> Vec<Variant> {
    let base = |name: String, alteration| Variant {
        name,
        alteration,
        ..declared.clone()
    };
    let mut out: Vec<Variant> = vec![];
    for (label, id) in mask_candidates {
        if *id == declared_mask || out.iter().any(|v| v.mask_token_id == Some(*id)) {
            continue;
        }
        if out.len() == MAX_MASK_VARIANTS {
            break;
        }
        out.push(Variant {
            mask_token_id: Some(*id),
            ..base(format!("mask {id} ({label})"), Alteration::MaskToken)
        });
    }
    let full = LayerAttention {
        causal: false,
        window: None,
    };
    if layers.iter().any(|a| *a != full) {
        out.push(Variant {
            attention: Some(Attention {
                causal: false,
                window: None,
            }),
            ..base("full attention".into(), Alteration::Attention)
        });
    } else if let Some(w) = sliding_window.filter(|&w| w > 0) {
        out.push(Variant {
            attention: Some(Attention {
                causal: true,
                window: Some(w),
            }),
            ..base(format!("sliding window {w}"), Alteration::Attention)
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const Z: BlockConvention = BlockConvention {
        position_offset: 0,
        anchor_slot_masked: false,
    };

    fn declared(taps: &[usize]) -> Variant {
        variants(taps, Z, 30, Some(false), None).remove(0)
    }

    #[test]
    fn variants_skip_shifts_that_leave_the_target() {
        let v = variants(&[1, 8, 14, 20, 27], Z, 30, Some(false), None);
        let names: Vec<&str> = v.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "declared",
                "taps -1",
                "taps +1",
                "final norm on last tap",
                "last tap on last layer",
                "positions -1",
                "positions +1",
                "slot 0 masked"
            ]
        );
        assert_eq!(v[1].target_layer_ids, [0, 7, 13, 19, 26]);
        assert_eq!(v[2].target_layer_ids, [2, 9, 15, 21, 28]);
        assert_eq!(v[4].target_layer_ids, [1, 8, 14, 20, 29]);
        // a config whose fc is fed the last layer: the default taps are the alternative
        let v = variants(&[1, 8, 14, 20, 29], Z, 30, Some(false), Some(10000.0));
        let names: Vec<&str> = v.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(
            &names[..4],
            [
                "declared",
                "taps -1",
                "final norm on last tap",
                "default taps"
            ]
        );
        assert_eq!(v[3].target_layer_ids, [1, 8, 14, 20, 27]);
        let rope = v.last().unwrap();
        assert_eq!(rope.alteration, Alteration::TargetRope);
        assert_eq!(rope.target_rope_theta, Some(10000.0));
        assert_eq!(rope.target_layer_ids, [1, 8, 14, 20, 29]);
        // layer 0 has no −1; layer 29 of 30 has no +1; no final norm, no norm variant; the last
        // tap is the last layer already; the default taps for two taps of 30 layers are [1, 27]
        let v = variants(&[0, 29], Z, 30, None, None);
        let names: Vec<&str> = v.iter().map(|v| v.name.as_str()).collect();
        // the fc fed the last layer: the last tap moved off it (to the default's 27), and the
        // default taps
        assert_eq!(
            &names[..3],
            ["declared", "last tap off last layer", "default taps"]
        );
        assert_eq!(v[1].target_layer_ids, [0, 27]);
        assert_eq!(v[1].alteration, Alteration::NotLastLayer);
        assert_eq!(v[2].target_layer_ids, [1, 27]);
        assert_eq!(v[3].position_offset, -1);
        assert!(v[5].anchor_slot_masked && v[5].target_layer_ids == [0, 29]);
        // every variant keeps the declared layout but for the one it changes
        assert!(v[..3]
            .iter()
            .all(|v| v.position_offset == 0 && !v.anchor_slot_masked));
    }

    #[test]
    fn layout_variants_are_moved_from_the_declared_layout() {
        // a config declaring slot j at anchor + j + 1 and the mask token in slot 0
        let conv = BlockConvention {
            position_offset: 1,
            anchor_slot_masked: true,
        };
        let v = variants(&[1, 8, 14, 20, 27], conv, 30, Some(false), None);
        assert_eq!((v[0].position_offset, v[0].anchor_slot_masked), (1, true));
        assert_eq!(v[0].convention(), conv);
        let pos: Vec<(&str, i64)> = v
            .iter()
            .filter(|v| v.alteration == Alteration::Positions)
            .map(|v| (v.name.as_str(), v.position_offset))
            .collect();
        assert_eq!(pos, [("positions -1", 0), ("positions +1", 2)]);
        let slot = v
            .iter()
            .find(|v| v.alteration == Alteration::AnchorSlot)
            .unwrap();
        assert_eq!(slot.name, "slot 0 anchor token");
        assert_eq!((slot.position_offset, slot.anchor_slot_masked), (1, false));
        // the tap variants keep the declared layout
        let shift = v
            .iter()
            .find(|v| v.alteration == Alteration::Shift)
            .unwrap();
        assert_eq!(shift.convention(), conv);
        let m = drafter_variants(&v[0], 16, &[("eos".into(), 2)], &[], None);
        assert_eq!(m[0].convention(), conv);
    }

    #[test]
    fn drafter_variants_skip_the_declared_mask_and_flip_the_attention() {
        let full = LayerAttention {
            causal: false,
            window: None,
        };
        let cands = [
            ("draft init's rule".to_string(), 16),
            ("eos".to_string(), 2),
            ("eos".to_string(), 2),
            ("vocab - 1".to_string(), 49151),
            ("bos".to_string(), 1),
        ];
        // the declared mask is skipped, the first other one measured (at most MAX_MASK_VARIANTS)
        let v = drafter_variants(&declared(&[1, 27]), 16, &cands, &[full; 3], None);
        let names: Vec<&str> = v.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(names, ["mask 2 (eos)"]);
        let v = drafter_variants(&declared(&[1, 27]), 2, &cands[1..], &[full; 3], None);
        assert_eq!(
            v[0].name, "mask 49151 (vocab - 1)",
            "the declared id is skipped"
        );
        assert!(v
            .iter()
            .all(|v| v.alters_drafter() && v.target_layer_ids == [1, 27]));
        // a declared window: the full-attention alternative
        let sliding = LayerAttention {
            causal: true,
            window: Some(8),
        };
        let v = drafter_variants(
            &declared(&[1, 27]),
            0,
            &cands[..1],
            &[full, sliding],
            Some(8),
        );
        assert_eq!(v.len(), 2);
        assert_eq!(v[0].mask_token_id, Some(16));
        assert_eq!(v[1].alteration, Alteration::Attention);
        assert_eq!(
            v[1].attention,
            Some(Attention {
                causal: false,
                window: None
            })
        );
        // all full with a window in the config: the sliding alternative; none without one
        let v = drafter_variants(&declared(&[1, 27]), 16, &[], &[full; 2], Some(8));
        assert_eq!(v[0].name, "sliding window 8");
        assert_eq!(v[0].attention.unwrap().window, Some(8));
        assert!(drafter_variants(&declared(&[1, 27]), 16, &[], &[full; 2], None).is_empty());
    }

    #[test]
    fn a_declared_final_norm_is_kept_by_every_variant_but_the_norm_one() {
        let v = variants(&[1, 8, 14, 20, 27], Z, 30, Some(true), None);
        let norm: Vec<&Variant> = v
            .iter()
            .filter(|v| v.alteration == Alteration::FinalNorm)
            .collect();
        assert_eq!(norm.len(), 1);
        assert_eq!(norm[0].name, "no final norm on last tap");
        assert!(!norm[0].final_norm_on_last_tap && norm[0].alters_drafter());
        assert!(v
            .iter()
            .filter(|v| v.alteration != Alteration::FinalNorm)
            .all(|v| v.final_norm_on_last_tap));
        let own = drafter_variants(&v[0], 16, &[("eos".into(), 2)], &[], None);
        assert!(own[0].final_norm_on_last_tap);
        // a target without a final norm: no norm variant
        let v = variants(&[1, 8, 14, 20, 27], Z, 30, None, None);
        assert!(v.iter().all(|v| v.alteration != Alteration::FinalNorm));
    }
}
