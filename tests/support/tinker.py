"""The Tinker API's test harness (docs/tinker.md): a service stack the real `tinker` SDK talks to,
the trainer's Tinker worker as a process that tests stop and start, and burstrl's own numbers
for the same tokens, to hold the SDK's results against.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from services.cli.launch import free_port
from tests.support.stack import ServiceStack, service_stack

TOKEN = "tinker-test-token-0123456789abcdef"
API_KEY = "tml-" + TOKEN
# The SDK's usage events stay on this machine (the api accepts and drops them anyway).
os.environ.setdefault("TINKER_TELEMETRY", "0")


@dataclass
class TinkerStack:
    stack: ServiceStack
    store: Path  # the file:// store's folder

    @property
    def base_url(self) -> str:
        return self.stack.api

    def start_worker(self, name: str = "tinker", **env: str) -> None:
        """The trainer's Tinker worker (`python -m services.trainer.tinker`), ready."""
        full = {**self.stack.env, "BURSTRL_TRAINER_THREADS": "1", **env}
        self.stack.launcher.start_service("trainer.tinker", full, name=name, port=free_port())
        self.stack.launcher.wait_ready([name], timeout=180)

    def stop_worker(self, name: str = "tinker", *, kill: bool = False) -> None:
        """SIGTERM (it checkpoints what it can), or SIGKILL with `kill` (it writes nothing more)."""
        if kill:
            import signal

            proc = self.stack.launcher.procs()[name]
            os.killpg(proc.pid, signal.SIGKILL)
        self.stack.launcher.stop(name, timeout=30)

    def client(self):  # noqa: ANN201 - tinker.ServiceClient
        import tinker

        return tinker.ServiceClient(base_url=self.base_url, api_key=API_KEY)


@contextmanager
def tinker_stack(tmp_path: Path, model: Path, roles: Sequence[str] = ("api",)) -> Iterator[TinkerStack]:
    """Redis, the api (and `roles`) as processes with a real token; no Tinker worker yet."""
    env = {"BURSTRL_TOKEN": TOKEN, "BURSTRL_DEV": "0"}
    with service_stack(tmp_path, model, list(roles), env_extra=env) as stack:
        yield TinkerStack(stack, tmp_path / "store")


def reference_logprobs(model_path: Path, tokens: list[int], *, rank: int, seed: int) -> list[float]:
    """burstrl's own trainer log-probs of `tokens` (log p(tokens[t+1] | tokens[: t+1])) under a fresh
    LoRA policy as the Tinker worker creates it: the job trainer's load_policy and its chunked pass."""
    import torch

    from services.trainer.policy import load_policy
    from shared.ml.chunked_logprobs import head_params, model_token_logprobs, resolve_logits_chunk

    model, _ = load_policy(str(model_path), rank=rank, alpha=min(32, 16 * rank), device="cpu", seed=seed)
    chunk = resolve_logits_chunk(0, int(head_params(model)[0].shape[0]))
    model.train()
    with torch.no_grad():
        return model_token_logprobs(model, torch.tensor([tokens]), chunk=chunk)[0].tolist()
