"""Every size limit of a job's input, in one place, with why each number.

A job spec is user input that every stage stores, reads and serves back (GET /v1/jobs
returns every record on every call), so each string, list, mapping and number in it is
bounded here, and the api refuses a body too large to be a spec before it parses it
(docs/architecture.md, invariant 8). The spec models (shared/job.py, the task and env
blocks in shared/domain) build their fields from these types; `SpecModel` is their
common base, so no float anywhere in a spec can be NaN or an infinity.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints

from shared.text import invisible_chars

# -- the api's door --------------------------------------------------------------------
# A real spec is a few kB; a long few-shot template (20 kB) and a judge prompt or two
# still fit 1 MiB many times over. The api refuses a bigger body before it parses a byte
# of it, and a stored record is about the size of the body it came from, so this also
# bounds what each record costs every reader of GET /v1/jobs.
BODY_MAX_BYTES = 1 << 20
# A 422 names the field and says what to fix; it echoes the offending value only up to
# this many characters, so a refused 10 MB string is not sent back whole.
ERROR_INPUT_MAX_CHARS = 200
# A 422 lists at most this many errors, then says how many more there were: a body of 100,000
# unknown keys made a 9.7 MB answer. The first few are what a client fixes first anyway.
ERROR_LIST_MAX = 20

# -- strings ---------------------------------------------------------------------------
# Registered names (tasks, verifiers, environments, reward parts): short identifiers.
NAME_MAX = 64
# A base model or teacher: a hub id (at most 96 characters on the Hugging Face Hub) or a
# local path; 1 KiB holds any real folder path with room.
MODEL_REF_MAX = 1024
# A data file path on the api's box: Linux's PATH_MAX.
PATH_MAX = 4096
# Column, split and dataset-config names of a prompt source.
COLUMN_MAX = 128
# A prompt template: a few-shot prompt with worked examples fits in 20 kB.
TEMPLATE_MAX = 20_000
# One stop string: stop sequences are short markers ("</answer>", "\n\n").
STOP_MAX_CHARS = 64
# A string argument of a verifier or an environment: a regex, a URL, or a judge's prompt
# template (the built-in one is 300 characters; 8 kB is a long rubric).
ARG_STR_MAX = 8192

# -- lists and mappings ------------------------------------------------------------------
STOP_MAX_ITEMS = 16  # vLLM checks every stop string after every token: a few markers suffice
VERIFIERS_MAX = 16  # weighted reward components per job
ARGS_MAX_KEYS = 32  # keyword arguments of one verifier or environment
ARG_LIST_MAX = 64  # items of a list-valued argument
FIELDS_MAX = 64  # source columns passed to the verifiers

# -- numbers ---------------------------------------------------------------------------
# Seeds feed random.Random, torch.manual_seed and numpy-style 32-bit seeders (Hugging
# Face's set_seed, vLLM's per-request seed): 0 .. 2**32 - 1 is what all of them take, and
# what a user typing a seed expects. 2**200 crash-looped the trainer (issue 18, item 13).
SEED_MAX = 2**32 - 1
# Numeric verifier/environment arguments: integers JSON readers (JavaScript) keep exactly.
ARG_NUMBER_MAX = 2**53
# The truncated importance-sampling cap: papers use 2..10; past 100 it truncates nothing.
TIS_CAP_MAX = 100.0

# -- the agent endpoint (services/rollout/agent_routes.py, docs/agents.md) -------------------
# Messages in one chat request: an agent sends its whole history each turn; 256 messages is a
# long tool-use episode (AGENT_MAX_TURNS model turns, each with a few tool results) with room.
CHAT_MESSAGES_MAX = 256
# Characters of one message's content (or of a completions prompt): the engine's context is
# the real bound (at most a few 10k tokens); 128k characters is well past any context here.
CHAT_CONTENT_MAX_CHARS = 131_072
# A chat request body: CHAT_MESSAGES_MAX messages of modest size; refused (413) before parsing.
CHAT_BODY_MAX_BYTES = 4 << 20
# Tools (function schemas) one request may declare, and stop strings it may add.
CHAT_TOOLS_MAX = 64
# Model turns one episode may take (AgentSpec.max_turns is at most this).
AGENT_MAX_TURNS = 64
# Episodes (agent sessions) one rollout replica keeps open at once, over all jobs: each holds
# its token ids in memory and a lease on a policy version.
AGENT_OPEN_EPISODES_MAX = 4096

# -- what the job's status warns about ---------------------------------------------------------
# Share of a job's recent completions that ended at the length cap above which its status
# warns that completions are being cut off (sampling.max_tokens or the engine's context).
TRUNCATION_WARN_FRAC = 0.5
# How many of the newest rollout points that share is measured over.
TRUNCATION_WINDOW_POINTS = 20


class SpecModel(BaseModel):
    """Base of every job-spec model: unknown fields are refused, floats must be finite.

    Python's JSON parser accepts the literals `NaN` and `Infinity`; stored, they came back
    as null and made the record unreadable for every reader (issue 18, item 12).
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def shown(value: str) -> str:
    """A string shown to people as an identifier (dashboard, CLI, logs): no control or format
    characters (a newline, a bidi override, a zero-width space), which would change how it, or
    the text around it, displays (shared/text.py)."""
    if found := invisible_chars(value):
        raise ValueError(
            f"holds {', '.join(found[:5])}: control and format characters (newlines, bidi overrides, zero-width "
            "spaces, Unicode categories Cc, Cf, Cs, Zl, Zp) are in no name, id or path"
        )
    return value


Shown = AfterValidator(shown)
Name = Annotated[str, StringConstraints(max_length=NAME_MAX), Shown]
ModelRef = Annotated[str, StringConstraints(max_length=MODEL_REF_MAX), Shown]
Column = Annotated[str, StringConstraints(max_length=COLUMN_MAX), Shown]
ArgKey = Annotated[str, StringConstraints(min_length=1, max_length=NAME_MAX), Shown]
ArgStr = Annotated[str, StringConstraints(max_length=ARG_STR_MAX)]
ArgInt = Annotated[int, Field(ge=-ARG_NUMBER_MAX, le=ARG_NUMBER_MAX)]
ArgFloat = Annotated[float, Field(ge=-float(ARG_NUMBER_MAX), le=float(ARG_NUMBER_MAX))]
# bool first: true/false stay booleans (smart-mode unions prefer the exact type anyway).
ArgScalar = bool | ArgInt | ArgFloat | ArgStr | None
ArgList = Annotated[list[ArgScalar], Field(max_length=ARG_LIST_MAX)]
