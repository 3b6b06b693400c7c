"""The recipes that build the tiny models from nothing: a random-init Qwen2 and a byte tokenizer,
then an SFT warm-start on a task's demonstrations.

The models the demo and the tests use are not built on a user's machine: they ship, built once
by these recipes, in shared/ml/weights/ (shared/ml/models.py copies them into place). A build of
minutes on one thread differs from one CPU type to the next (another ISA picks other kernels), so
shipping the bytes is what makes every machine run the same model, and every tolerance and
learning margin in the tests rest on one model. These recipes remain what made those bytes:
`burstrl init-model --rebuild` builds one, `make models` rebuilds every shipped one in place, and
tests/integration/test_model_builds.py checks that a recipe still learns.

Every build runs on one intra-op thread (shared/ml/threads.py): the same bytes on one CPU type,
whatever ran before in the process.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import random
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from shared.ml.threads import one_thread

Log = Callable[[str], None]


@dataclass(frozen=True)
class Recipe:
    """How one named model is built. `student`: the model it starts from (built first), else
    the tiny architecture's random init."""

    name: str
    what: str
    note: str  # logged as the SFT starts
    sft: Callable[[Path, Path], object]  # (the model it starts from, out) -> writes out
    student: str | None = None


def build(recipe: Recipe, out: Path, *, start: Path | None = None, log: Log = print) -> Path:
    """Build `recipe` into `out` (replacing what is there). `start`: the built student, for a
    recipe that has one. Runs on one thread, under a lock beside `out`."""
    from shared.ml.tiny_model import build_model

    out = out.resolve()
    with _building(out):
        shutil.rmtree(out, ignore_errors=True)
        if recipe.student is None:
            base = out.parent / (out.name + "-base")
            shutil.rmtree(base, ignore_errors=True)
            log(f"building the {recipe.what}: random init in {base}")
            build_model(base)
        else:
            if start is None:
                raise ValueError(f"recipe {recipe.name} starts from {recipe.student}: pass its built folder")
            base = start
        log(recipe.note)
        recipe.sft(base, out)
        shutil.rmtree(out / "_sft_run", ignore_errors=True)
        if recipe.student is None:
            shutil.rmtree(base, ignore_errors=True)
    return out


@contextlib.contextmanager
def _building(out: Path) -> Iterator[None]:
    """An exclusive lock beside `out` while it is built: two processes asking for the same build
    must not write one folder at once (flock is released by the kernel if the builder dies), and
    one thread for the build (shared/ml/threads.py)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            with one_thread():
                yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _sft(**kwargs: object) -> Callable[[Path, Path], object]:
    def run(base: Path, out: Path) -> object:
        from shared.ml.sft import sft_warm_start

        return sft_warm_start(base, out, **kwargs)  # type: ignore[arg-type]

    return run


def _sft_rg(base: Path, out: Path) -> object:
    from shared.ml.sft_rg import sft_rg

    return sft_rg(base, out)


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

    masked_sft(
        model,
        tok,
        out_dir,
        (example(it) for it in items),
        steps=steps,
        batch_size=batch_size,
        learning_rate=learning_rate,
        what=f"{task} tool-use",
    )


def _tool(task: str) -> Callable[[Path, Path], object]:
    return lambda base, out: _sft_tool_use(base, out, task=task)


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        # The demo's and most tests' model: SFT'd on noisy "a+b=" demonstrations, partly right, so
        # GRPO has signal (shared/ml/sft.py says how).
        Recipe("tiny-sft", "tiny model", "SFT warm-start with TRL (600 steps)", _sft()),
        # The distillation test's teacher: the tiny model trained further on clean demos (the right
        # sum, then EOS, every time), so it is much better than the student it starts from.
        Recipe(
            "tiny-teacher",
            "distillation teacher",
            "SFT of the tiny model on clean demonstrations (300 steps)",
            _sft(steps=300, batch_size=128, learning_rate=1e-3, seed=1, correct_fraction=1.0),
            student="tiny-sft",
        ),
        # The tool-use demo's model: 3-digit sums ("arith3"), 40% of the demonstrations calling the
        # calculator (`<calc>a+b</calc>`, the tool's `=s`, then an empty turn that submits it). It
        # can call the tool but mostly does not, and its direct answers are mostly wrong: RL through
        # the "calc" environment should teach it to use the tool. The tool's output is masked out of
        # the SFT loss as it is out of the RL loss: trained on, the model would learn to predict the
        # sum itself (which it cannot) instead of reading it.
        Recipe("tiny-calc", "tool-use tiny model", "SFT on 'arith3' tool-call demonstrations", _tool("arith3")),
        # The Python-tool demo's model: the same recipe on "arith3py" (`<python>print(a+b)</python>`,
        # the sandbox's `<output>s</output>`, masked).
        Recipe(
            "tiny-python", "Python-tool tiny model", "SFT on 'arith3py' tool-call demonstrations", _tool("arith3py")
        ),
        # The reasoning-gym demo's model (examples/demo_rg.toml): the tiny architecture SFT'd briefly
        # on the demo task's own train items (shared/ml/sft_rg.py), stopped at partial competence.
        # Random init, not tiny-sft: nothing from burstrl's own arith data is in it.
        Recipe("tiny-sft-rg", "reasoning-gym tiny model", "SFT on reasoning-gym chain_sum train items", _sft_rg),
        # The long-completion model of the TRL comparison (bench/trl_compare.py --task countup):
        # "countup" traces, a quarter stopping at a+b and the rest one number late, so that GRPO has
        # to learn where to stop. Not shipped: only that benchmark uses it, and builds it.
        Recipe("tiny-countup", "counting tiny model", "SFT on 'countup' traces", _sft(task_name="countup")),
    )
}
