use super::*;

const SMOL_SYSTEM: &str = "You are a helpful AI assistant named SmolLM, trained by Hugging Face";

fn chatml(system: Option<&str>, user: &str, tail: &str, answer: &str) -> PromptText {
    let sys = system
        .map(|s| format!("<|im_start|>system\n{s}<|im_end|>\n"))
        .unwrap_or_default();
    PromptText {
        prompt: format!("{sys}<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n{tail}"),
        answer_prefix: answer.into(),
    }
}

fn llama3(system: &str, user: &str) -> PromptText {
    PromptText {
        prompt: format!(
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n{system}<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n{user}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        ),
        answer_prefix: "Sure".into(),
    }
}

fn many(n: usize, t: &PromptText) -> Vec<PromptText> {
    vec![t.clone(); n]
}

#[test]
fn detects_family_system_prompt_and_thinking_of_one_example() {
    let f = ExampleFormat::detect(&chatml(Some(SMOL_SYSTEM), "Hi", "", "Hello"));
    assert_eq!(f.template, TemplateFamily::ChatMl);
    assert_eq!(f.system_prompt.as_deref(), Some(SMOL_SYSTEM));
    assert!(!f.thinking);
    let f = ExampleFormat::detect(&chatml(None, "Hi", "", "Hello"));
    assert_eq!(
        (f.template, f.system_prompt, f.thinking),
        (TemplateFamily::ChatMl, None, false)
    );
    // Qwen3: the empty block of thinking off; thinking on opens the answer
    let off = chatml(None, "Hi", "<think>\n\n</think>\n\n", "Hello");
    assert!(!ExampleFormat::detect(&off).thinking);
    let on = chatml(None, "Hi", "", "<think>\nOkay, the user");
    assert!(ExampleFormat::detect(&on).thinking);
    // a template that opens the block itself
    assert!(ExampleFormat::detect(&chatml(None, "Hi", "<think>\n", "Okay")).thinking);
    // a <think> in an earlier turn's text is not the generation's
    let mut t = chatml(None, "Explain <think> tags", "", "Sure");
    t.prompt = format!(
        "{}<|im_end|>\n<|im_start|>user\nMore<|im_end|>\n<|im_start|>assistant\n",
        t.prompt
    );
    assert!(!ExampleFormat::detect(&t).thinking);
    // a user turn first is no system prompt, even with a system turn later
    let t = PromptText {
        prompt: "<|im_start|>user\nHi<|im_end|>\n<|im_start|>system\nLate<|im_end|>\n".into(),
        answer_prefix: String::new(),
    };
    assert_eq!(ExampleFormat::detect(&t).system_prompt, None);

    let f = ExampleFormat::detect(&llama3("Cutting Knowledge Date: December 2023", "Hi"));
    assert_eq!(f.template, TemplateFamily::Llama3);
    assert_eq!(
        f.system_prompt.as_deref(),
        Some("Cutting Knowledge Date: December 2023")
    );
    let gemma = PromptText {
        prompt: "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
            .into(),
        answer_prefix: "Hello".into(),
    };
    let f = ExampleFormat::detect(&gemma);
    assert_eq!(
        (f.template, f.system_prompt, f.thinking),
        (TemplateFamily::Gemma, None, false)
    );
    let plain = PromptText {
        prompt: "Question: what is 2+2?\nAnswer:".into(),
        answer_prefix: " 4".into(),
    };
    assert_eq!(
        ExampleFormat::detect(&plain).template,
        TemplateFamily::Plain
    );
    let mistral = PromptText {
        prompt: "<s>[INST] Hi [/INST]".into(),
        answer_prefix: "Hello".into(),
    };
    assert_eq!(
        ExampleFormat::detect(&mistral).template,
        TemplateFamily::Mistral
    );
}

#[test]
fn strips_the_opening_system_turn() {
    let t = chatml(Some(SMOL_SYSTEM), "Hi", "", "");
    assert_eq!(
        strip_system_turn(&t.prompt, TemplateFamily::ChatMl).unwrap(),
        chatml(None, "Hi", "", "").prompt
    );
    assert_eq!(
        strip_system_turn(&chatml(None, "Hi", "", "").prompt, TemplateFamily::ChatMl),
        None
    );
    let l = llama3("Date", "Hi").prompt;
    assert_eq!(
        strip_system_turn(&l, TemplateFamily::Llama3).unwrap(),
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    );
    assert_eq!(strip_system_turn("plain", TemplateFamily::Plain), None);
}

#[test]
fn profiles_give_the_most_common_value_and_each_share() {
    let mut texts = many(3, &chatml(Some("You are a pirate."), "Hi", "", "Arr"));
    texts.push(chatml(None, "Hi", "", "Hello"));
    texts.push(chatml(Some("Be terse."), "Hi", "", "<think>\nhmm"));
    texts.push(llama3("Date", "Hi"));
    let p = FormatProfile::measure(&texts);
    assert_eq!(p.examples, 6);
    assert_eq!(p.template, TemplateFamily::ChatMl);
    assert!((p.template_share - 5.0 / 6.0).abs() < 1e-12);
    assert!((p.template_share_of(TemplateFamily::Llama3) - 1.0 / 6.0).abs() < 1e-12);
    assert_eq!(p.system_prompt.as_deref(), Some("You are a pirate."));
    assert!((p.system_prompt_share - 0.5).abs() < 1e-12);
    assert!((p.with_system_prompt_share - 5.0 / 6.0).abs() < 1e-12);
    assert!((p.system_share_of(None) - 1.0 / 6.0).abs() < 1e-12);
    assert_eq!(p.system_share_of(Some("never")), 0.0);
    assert_eq!(p.system_prompts.len(), 4);
    assert_eq!(p.other_system_prompt_examples, 0);
    assert!(!p.thinking);
    assert_eq!(p.thinking_examples, 1);
    assert!((p.thinking_share - 5.0 / 6.0).abs() < 1e-12);
    // the system prompts beyond the listed ones are counted, not listed
    let texts: Vec<PromptText> = (0..MAX_SYSTEM_PROMPTS + 2)
        .map(|i| chatml(Some(&format!("system {i}")), "Hi", "", ""))
        .collect();
    let p = FormatProfile::measure(&texts);
    assert_eq!(p.system_prompts.len(), MAX_SYSTEM_PROMPTS);
    assert_eq!(p.other_system_prompt_examples, 2);
    // an empty set
    let p = FormatProfile::measure(&[]);
    assert_eq!((p.examples, p.template_share), (0, 0.0));
}

#[test]
fn matching_formats_are_ok_and_no_data_says_so() {
    let eval = FormatProfile::measure(&many(4, &chatml(Some(SMOL_SYSTEM), "Q", "", "A")));
    let train = FormatProfile::measure(&many(50, &chatml(Some(SMOL_SYSTEM), "T", "", "B")));
    let c = judge(&eval, &train, None);
    assert_eq!(c.verdict, Verdict::Ok, "{c:?}");
    assert!(c.evidence.contains("ChatML (100 %)"), "{}", c.evidence);
    assert!(c.cause.is_empty() && c.fix.is_empty());
    assert_eq!(plan(&eval, &train), Plan::Matching);
    let c = no_data(&eval);
    assert_eq!(c.verdict, Verdict::Ok);
    assert!(
        c.evidence.starts_with("no training data given (--data)"),
        "{}",
        c.evidence
    );
}

#[test]
fn a_system_prompt_only_the_training_data_has_warns_with_tau() {
    let eval = FormatProfile::measure(&many(4, &chatml(None, "Q", "", "A")));
    let mut train = many(
        97,
        &chatml(Some("You are a careful math tutor."), "T", "", "B"),
    );
    train.extend(many(3, &chatml(None, "T", "", "B")));
    let train = FormatProfile::measure(&train);
    assert_eq!(mismatches(&eval, &train), [Aspect::SystemPrompt]);
    let c = judge(&eval, &train, Some((2.5, 3.0)));
    assert_eq!(c.verdict, Verdict::Warn, "{c:?}");
    assert!(
        c.cause.contains("eval prompts have no system prompt; training data used 'You are a careful math tutor.' in 97 % of examples"),
        "{}",
        c.cause
    );
    assert!(
        c.fix
            .contains("render eval prompts with the system prompt 'You are a careful math tutor.'"),
        "{}",
        c.fix
    );
    assert!(
        c.evidence
            .contains("tau 2.50 under the eval format vs 3.00 under the training format (+20 %)"),
        "{}",
        c.evidence
    );
    assert_eq!(
        plan(&eval, &train),
        Plan::Render(Rerender {
            template: TemplateFamily::ChatMl,
            system: SystemChange::Set("You are a careful math tutor.".into()),
            enable_thinking: None,
        })
    );
    // without τ the evidence says it was not measured
    assert!(judge(&eval, &train, None).evidence.contains("not measured"));
}

#[test]
fn a_template_default_system_prompt_the_training_data_lacks_is_removed() {
    let eval = FormatProfile::measure(&many(4, &chatml(Some(SMOL_SYSTEM), "Q", "", "A")));
    let train = FormatProfile::measure(&many(20, &chatml(None, "T", "", "B")));
    let c = judge(&eval, &train, None);
    assert_eq!(c.verdict, Verdict::Warn);
    assert!(
        c.cause
            .contains("eval prompts carry the system prompt 'You are a helpful AI"),
        "{}",
        c.cause
    );
    assert!(
        c.cause
            .contains("training data had no system prompt in 100 %"),
        "{}",
        c.cause
    );
    assert!(matches!(
        plan(&eval, &train),
        Plan::Render(Rerender {
            system: SystemChange::Remove,
            ..
        })
    ));
    // another system prompt: set the training data's
    let pirate =
        FormatProfile::measure(&many(20, &chatml(Some("You are a pirate."), "T", "", "B")));
    let c = judge(&eval, &pirate, Some((3.0, 3.3)));
    assert_eq!(c.verdict, Verdict::Warn);
    assert!(
        c.fix
            .contains("'You are a pirate.', or retrain on data rendered with 'You are a helpful"),
        "{}",
        c.fix
    );
}

#[test]
fn thinking_on_off_within_one_template_warns_and_renders_with_enable_thinking() {
    let eval = FormatProfile::measure(&many(4, &chatml(None, "Q", "<think>\n\n</think>\n\n", "A")));
    let train = FormatProfile::measure(&many(10, &chatml(None, "T", "", "<think>\nLet me")));
    assert!(train.thinking && !eval.thinking);
    assert_eq!(mismatches(&eval, &train), [Aspect::Thinking]);
    let c = judge(&eval, &train, Some((3.0, 2.0)));
    assert_eq!(c.verdict, Verdict::Warn);
    assert!(
        c.cause
            .contains("eval prompts have thinking off; training data has thinking on in 100 %"),
        "{}",
        c.cause
    );
    assert!(c.fix.contains("enable_thinking=true"), "{}", c.fix);
    assert!(c.evidence.contains("(-33 %)"), "{}", c.evidence);
    assert_eq!(
        plan(&eval, &train),
        Plan::Render(Rerender {
            template: TemplateFamily::ChatMl,
            system: SystemChange::Keep,
            enable_thinking: Some(true),
        })
    );
}

#[test]
fn another_template_family_warns_and_cannot_be_rendered() {
    let eval = FormatProfile::measure(&many(4, &chatml(None, "Q", "", "A")));
    let train = FormatProfile::measure(&many(10, &llama3("Date", "T")));
    let m = mismatches(&eval, &train);
    assert_eq!(m, [Aspect::Template, Aspect::SystemPrompt]);
    let c = judge(&eval, &train, None);
    assert_eq!(c.verdict, Verdict::Warn);
    assert!(
        c.cause
            .contains("eval prompts use the ChatML template; training data used Llama-3 in 100 %"),
        "{}",
        c.cause
    );
    assert!(c.fix.contains("dflash data regen"), "{}", c.fix);
    assert!(
        matches!(plan(&eval, &train), Plan::NotRenderable(why) if why.contains("ChatML vs Llama-3"))
    );
}

#[test]
fn a_mixed_training_set_covering_the_eval_format_is_ok() {
    let eval = FormatProfile::measure(&many(4, &chatml(None, "Q", "", "A")));
    // 30 % without a system prompt, 20 % thinking: the eval format is covered
    let mut t = many(60, &chatml(Some("You are a pirate."), "T", "", "B"));
    t.extend(many(30, &chatml(None, "T", "", "B")));
    t.extend(many(
        10,
        &chatml(Some("You are a pirate."), "T", "", "<think>\nhm"),
    ));
    let train = FormatProfile::measure(&t);
    assert_eq!(train.system_prompt.as_deref(), Some("You are a pirate."));
    assert!(mismatches(&eval, &train).is_empty());
    assert_eq!(judge(&eval, &train, None).verdict, Verdict::Ok);
    // 20 % is not enough
    let mut t = many(80, &chatml(Some("You are a pirate."), "T", "", "B"));
    t.extend(many(20, &chatml(None, "T", "", "B")));
    let train = FormatProfile::measure(&t);
    assert_eq!(mismatches(&eval, &train), [Aspect::SystemPrompt]);
}
