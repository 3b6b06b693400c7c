"""Build the tiny model once (idempotent): random Qwen2 + byte tokenizer, then SFT."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from shared.ml import build_cache
from shared.ml.threads import one_thread

DONE = "burstrl_ready.json"
# Bump when the model or SFT recipe changes, so cached models are rebuilt.
RECIPE = "arith-slip0-sft600x128-1thread-v3"


def ensure_tiny_model(out: Path, *, force: bool = False, log: Callable[[str], None] = print) -> Path:
    note = "SFT warm-start with TRL (600 steps; minutes on 2 cores, more on a busy box)"
    return _ensure_warm_started(out, RECIPE, "tiny model", note, {}, force=force, log=log)


def _ensure_warm_started(
    out: Path, recipe: str, what: str, note: str, sft_args: dict[str, str], *, force: bool, log: Callable[[str], None]
) -> Path:
    """A tiny model SFT'd by `sft_warm_start(base, out, **sft_args)` (`note` logged as it starts)."""
    from shared.ml.sft import sft_warm_start

    sft = (note, lambda base, into: sft_warm_start(base, into, **sft_args))
    return _build_once(out, recipe, what=what, sft=sft, force=force, log=log, cached=True)


def _build_once(
    out: Path,
    recipe: str,
    *,
    what: str,
    sft: tuple[str, Callable[[Path, Path], object]],
    force: bool,
    log: Callable[[str], None],
    cached: bool = False,
) -> Path:
    """Random-init tiny model in `out`-base, then `sft` (a log line, a base -> out trainer) into
    `out`; skipped when `out` already holds this recipe's model. `cached`: `sft` is one of this
    module's own (fixed in shared/'s source), so the build may come from, and goes to, the
    machine's model cache (shared/ml/build_cache.py); `force` rebuilds without reading it."""
    out = out.resolve()
    if (out / DONE).exists() and not force and json.loads((out / DONE).read_text()).get("recipe") == recipe:
        return out
    with _building(out):
        if (out / DONE).exists() and not force and json.loads((out / DONE).read_text()).get("recipe") == recipe:
            return out  # another process built it while this one waited
        key = build_cache.build_key({"recipe": recipe}) if cached else None
        _restore_or_build(out, key, what, lambda: _build(out, recipe, what=what, sft=sft, log=log), force, log)
        return out


def _restore_or_build(
    out: Path, key: str | None, what: str, build: Callable[[], object], force: bool, log: Callable[[str], None]
) -> None:
    """`out` from the model cache's entry `key` (shared/ml/build_cache.py) unless `force`, else
    `build()` it and store it there; no `key`: always build, never store."""
    if key and not force and build_cache.restore(key, out):
        log(f"the {what} came from the model cache ({build_cache.cache_root()}/{key})")
        return
    build()
    if key:
        build_cache.store(key, out)


@contextlib.contextmanager
def _building(out: Path) -> Iterator[None]:
    """An exclusive lock beside `out` while it is built: `make demo` and test processes (or two
    pytest workers) may ask for the same model at once, and a half-built folder must not be
    read or built twice. flock is released by the kernel if the builder dies. Every build runs in
    here, so every build runs on one thread (one_thread)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            with one_thread():
                yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _build(
    out: Path,
    recipe: str,
    *,
    what: str,
    sft: tuple[str, Callable[[Path, Path], object]],
    log: Callable[[str], None],
) -> Path:
    from shared.ml.tiny_model import build_model

    base = out.parent / (out.name + "-base")
    shutil.rmtree(base, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    log(f"building the {what} in {base}")
    build_model(base)
    log(sft[0])
    sft[1](base, out)
    shutil.rmtree(out / "_sft_run", ignore_errors=True)
    (out / DONE).write_text(json.dumps({"base": str(base), "recipe": recipe}))
    return out


# The reasoning-gym demo's model (examples/demo_rg.toml): the tiny architecture SFT'd briefly on
# the demo task's own train items (shared/ml/sft_rg.py), stopped at partial competence (~0.15
# held-out pass@1 at T=1) so that GRPO groups have variance. tiny-sft cannot serve: it scores ~0
# on reasoning-gym's prompts (examples/rg_tiny_v0.py). Random init, not tiny-sft: the build
# stands alone, and nothing from burstrl's own arith data is in it. GRPO does not improve it
# (README, "Tasks from reasoning-gym").
RG_RECIPE = "rg-chain_sum-2to3x1digit-sft300x64-v1"
RG_MODEL_NAME = "tiny-sft-rg"  # its folder under <home>/models: examples/demo_rg.toml's base_model


def ensure_rg_model(out: Path, *, force: bool = False, log: Callable[[str], None] = print) -> Path:
    from shared.ml.sft_rg import RG_TASK, sft_rg

    return _build_once(
        out,
        RG_RECIPE,
        what="reasoning-gym tiny model",
        sft=(f"SFT warm-start on {RG_TASK} train items (about 90 s on 2 cores)", lambda base, out: sft_rg(base, out)),
        force=force,
        log=log,
        cached=True,
    )


# The teacher of the distillation test: the tiny SFT model trained further on clean demos
# (the right sum, then EOS, every time), so it is much better than the student it starts from.
TEACHER_RECIPE = "arith-teacher-clean300x128-1thread-v2"


def ensure_teacher_model(out: Path, student: Path, *, force: bool = False, log: Callable[[str], None] = print) -> Path:
    """Build (once) a same-tokenizer teacher from the tiny student by a longer, clean SFT."""
    out, student = out.resolve(), student.resolve()
    want = {"student": str(student), "recipe": TEACHER_RECIPE, "student_recipe": RECIPE}
    if (out / DONE).exists() and not force and json.loads((out / DONE).read_text()) == want:
        return out
    with _building(out):
        if (out / DONE).exists() and not force and json.loads((out / DONE).read_text()) == want:
            return out
        # keyed by the student's weights, not its path: the same student in another clone
        student_digest = hashlib.sha256((student / "model.safetensors").read_bytes()).hexdigest()
        key = build_cache.build_key({"recipe": TEACHER_RECIPE, "student": student_digest})
        _restore_or_build(out, key, "distillation teacher", lambda: _build_teacher(out, student, log), force, log)
        (out / DONE).write_text(json.dumps(want))  # last: this clone's student path, also on a restore
        return out


def _build_teacher(out: Path, student: Path, log: Callable[[str], None]) -> None:
    from shared.ml.sft import sft_warm_start

    shutil.rmtree(out, ignore_errors=True)
    log(f"building the distillation teacher in {out} (SFT of {student} on clean demonstrations)")
    sft_warm_start(student, out, steps=300, batch_size=128, learning_rate=1e-3, seed=1, correct_fraction=1.0)
    shutil.rmtree(out / "_sft_run", ignore_errors=True)


# The long-completion model of the TRL comparison (bench/trl_compare.py --task countup): the
# tiny architecture SFT'd on "countup" traces, a quarter of them stopping at a+b and the rest
# one number late, so that, as with "arith", GRPO has to learn where to stop.
COUNTUP_RECIPE = "countup-slip-sft600x128-1thread-v2"


def ensure_countup_model(out: Path, *, force: bool = False, log: Callable[[str], None] = print) -> Path:
    note = "SFT warm-start on 'countup' traces (about 10 minutes on 2 cores)"
    sft_args = {"task_name": "countup"}
    return _ensure_warm_started(out, COUNTUP_RECIPE, "counting tiny model", note, sft_args, force=force, log=log)


# The tool-use demo's model: the tiny architecture SFT'd on 3-digit sums ("arith3"), where
# 40% of the demonstrations call the calculator (`<calc>a+b</calc>`, the tool's `=s`, then an
# empty turn that submits the tool's result) and the rest answer directly. It can call the tool but mostly does not, and its direct
# answers are mostly wrong: RL through the "calc" environment should teach it to use the tool.
# The tool's output is masked out of the SFT loss as it is out of the RL loss: trained on, the
# model would learn to predict the sum itself (which it cannot) instead of reading it.
CALC_RECIPE = "arith3-calc40-submit-masked-sft1000x64-v4"


def ensure_calc_model(out: Path, *, force: bool = False, log: Callable[[str], None] = print) -> Path:
    return _ensure_tool_model(out, "arith3", CALC_RECIPE, force=force, log=log)


# The Python-tool demo's model: the same recipe on "arith3py", whose tool-call demonstrations
# are `<python>print(a+b)</python>`, the sandbox's `<output>s</output>` (masked), then an empty
# turn that submits it. RL through the "python" environment should teach it to run the code.
PYTHON_RECIPE = "arith3py-python40-submit-masked-sft1000x64-v1"


def ensure_python_model(out: Path, *, force: bool = False, log: Callable[[str], None] = print) -> Path:
    return _ensure_tool_model(out, "arith3py", PYTHON_RECIPE, force=force, log=log)


def _ensure_tool_model(
    out: Path, task: str, recipe: str, *, force: bool = False, log: Callable[[str], None] = print
) -> Path:
    return _build_once(
        out,
        recipe,
        what="tool-use tiny model",
        sft=(
            f"SFT warm-start on {task!r} tool-call demonstrations (a minute or two on 2 cores)",
            lambda base, out: _sft_tool_use(base, out, task=task),
        ),
        force=force,
        log=log,
        cached=True,
    )


# Where each tool-use task's demonstration ends the model's call (its environment's stop
# string): what follows is the tool's answer, masked out of the loss (the model reads it).
TOOL_CALL_ENDS = {"arith3": "</calc>", "arith3py": "</python>"}


def _sft_tool_use(
    model_dir: Path,
    out_dir: Path,
    *,
    task: str = "arith3",
    # 1000 steps: at 400 the model had not yet learned to copy the operands into the call.
    steps: int = 1000,
    batch_size: int = 64,
    learning_rate: float = 3e-3,
    tool_fraction: float = 0.4,
    seed: int = 0,
) -> None:
    """A plain masked SFT loop (TRL's completion-only loss cannot mask the tool's output).

    The demonstrations are the task's own (`demonstration(item, rng, tool_fraction)`): a tool
    call, the tool's output, then an empty turn (EOS) that submits it; or a direct answer.
    """
    import itertools
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.domain.envs.calc import Arith3Task
    from shared.domain.envs.python_tool import Arith3PyTask
    from shared.domain.tasks.base import TaskItem
    from shared.ml.sft import masked_sft

    # The concrete classes, not the registry: `demonstration` is theirs, not the Task protocol's.
    the_task: Arith3Task = {"arith3": Arith3Task, "arith3py": Arith3PyTask}[task]()
    call_end = TOOL_CALL_ENDS[task]
    torch.manual_seed(seed)
    rng = random.Random(seed)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    items = itertools.islice(the_task.train_items(seed), steps * batch_size)

    def example(item: TaskItem) -> tuple[list[int], list[int]]:
        # One rng draw per item, as before the generalisation: the calc model's data (and so
        # its weights, and CALC_RECIPE's cache) are unchanged.
        demo = the_task.demonstration(item, rng, tool_fraction)
        segs = [(item.prompt, False)]  # (text, trained on)
        if call_end in demo:
            # call, the tool's output (masked), then an empty turn: submit the tool's result
            call, output = demo.split(call_end, 1)
            segs += [(call + call_end, True), (output, False), (tok.eos_token, True)]
        else:
            segs += [(demo + tok.eos_token, True)]
        ids, labels = [], []
        for text, trained in segs:
            t = tok(text, add_special_tokens=False)["input_ids"]
            ids += t
            labels += t if trained else [-100] * len(t)
        return ids, labels

    examples = (example(it) for it in items)
    masked_sft(
        model,
        tok,
        out_dir,
        examples,
        steps=steps,
        batch_size=batch_size,
        learning_rate=learning_rate,
        what=f"{task} tool-use",
    )
