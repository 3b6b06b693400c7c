"""The table of reasoning-gym datasets in docs/tasks.md: which generate, score and fit a context.

    PYTHONPATH=. .venv/bin/python -m shared.domain.tasks.rg_table --out docs/tasks.md

Each dataset runs with its default options through RgTask itself (the path a job takes):
ITEMS train items and HELD held-out items are generated, and each train item's own answer,
wrapped in <answer> tags, is scored from the item's JSON fields (what crosses Redis and the
reward service's process boundary). "fits" counts prompt + tagged answer + EOS in bytes, the
tiny model's byte-level tokens, against --max-len (the rollout's max_model_len).
"""

from __future__ import annotations

import argparse
import itertools
import signal
import time
from pathlib import Path
from typing import Any

from shared.domain.tasks.rg import CHUNK, UNSUPPORTED, RgTask, dataset_names

ITEMS = 20
HELD = 8
BEGIN, END = "<!-- rg-table:begin -->", "<!-- rg-table:end -->"


class _Slow(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Slow


def survey(name: str, max_len: int, timeout_s: int) -> dict[str, Any]:
    """One dataset's row; never raises."""
    signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(timeout_s)
    t0 = time.perf_counter()
    try:
        task = RgTask(name)
        items = list(itertools.islice(task.train_items(0), ITEMS))
        gen_s = time.perf_counter() - t0
        held = task.heldout_items(HELD)
        golds, needs = [], []
        for it in items:
            answer = it.fields["answer"]
            tagged = f"<answer>{answer}</answer>"
            golds.append(task.score(tagged, it.fields)["correct"] if answer else None)
            needs.append(len(it.prompt.encode()) + len(tagged.encode()) + 1)
        return {
            "name": name,
            "ok": True,
            "ms": 1000 * gen_s / ITEMS,
            "gold": [g for g in golds if g is not None],
            "no_gold": sum(g is None for g in golds),
            "held": len(held),
            "prompt_max": max(len(it.prompt.encode()) for it in items),
            "need_max": max(needs),
            "fits": sum(n <= max_len for n in needs),
        }
    except _Slow:
        return {"name": name, "ok": False, "why": f"over {timeout_s} s"}
    except Exception as e:
        return {"name": name, "ok": False, "why": f"{type(e).__name__}: {str(e)[:120]}"}
    finally:
        signal.alarm(0)


def row(s: dict[str, Any], max_len: int) -> str:
    if not s["ok"]:
        return f"| {s['name']} | no: {s['why'].replace('|', '/')} | | | | | |"
    g = s["gold"]
    if not g:
        gold = "no single answer"
    else:
        ones = sum(x >= 1.0 for x in g)
        gold = f"{ones}/{len(g)}" + ("" if ones == len(g) else f" (mean {sum(g) / len(g):.2f})")
    if s["no_gold"] and g:
        gold += f", {s['no_gold']} without one"
    fits = "yes" if s["fits"] == ITEMS else ("no" if s["fits"] == 0 else f"{s['fits']}/{ITEMS}")
    return f"| {s['name']} | yes | {gold} | {s['held']}/{HELD} | {s['prompt_max']} | {fits} | {s['ms']:.1f} |"


def table(max_len: int, timeout_s: int, names: list[str] | None = None) -> str:
    names = names or dataset_names()  # imports reasoning-gym before the first dataset's clock starts
    rows = [survey(n, max_len, timeout_s) for n in names]
    works = [s for s in rows if s["ok"] and s["gold"] and all(x >= 1.0 for x in s["gold"]) and s["held"] > 0]
    short = [s["name"] for s in works if s["fits"] == ITEMS]
    head = [
        f"{len(rows)} datasets of reasoning-gym with their default options; {len(works)} generate, score their own "
        f"answers 1.0 through the JSON fields and have a held-out split; {len(short)} of those fit {max_len} "
        f"byte tokens: {', '.join(short) or 'none'}. Not offered: "
        + "; ".join(f"{k} ({v})" for k, v in UNSUPPORTED.items())
        + ".",
        "",
        f"| dataset | generates | own answer scores 1.0 | held-out found | prompt bytes (max) | fits {max_len} "
        f"| ms per item (first {ITEMS}, incl. a {CHUNK}-item chunk's setup) |",
        "|---|---|---|---|---|---|---|",
    ]
    return "\n".join(head + [row(s, max_len) for s in rows])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="markdown file whose rg-table block is replaced")
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--timeout-s", type=int, default=60, help="per dataset")
    ap.add_argument("--only", nargs="*", help="these datasets only")
    a = ap.parse_args()
    text = table(a.max_len, a.timeout_s, a.only)
    if a.out is None:
        print(text)
        return
    doc = a.out.read_text()
    start, stop = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    a.out.write_text(doc[:start] + "\n" + text + "\n" + doc[stop:])


if __name__ == "__main__":
    main()
