"""A served on-policy-distillation teacher: the log-prob of each sampled response token under a
model behind SGLang's `/generate` (SGLang itself, or `mileage serve`), journaled.

Each sample is one prefill-only request (`max_new_tokens` 0, `return_logprob`,
`logprob_start_len` at the prompt's last token), as slime's OPD reward function sends it. A
request that fails (refused connection, timeout, HTTP error, a reply without one finite log-prob
per asked token, for the tokens asked) is retried (`--opd-teacher-attempts` tries in all);
then the run stops in one line naming each failure, and nothing of the rollout is saved.

Exact resume: the scores are appended to the run's journal (`mileage.rollout.journal`, the
tool journal's slot of the rollout) before training uses them, keyed by the sample's position
and checked against its token ids. A run killed after scoring and rerun reads them back, so it
trains on the teacher's answers of the killed run even when the server's would now differ
(another server, other hardware, a non-deterministic kernel).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Any

from mileage.rollout.engines.http import BadReply, ServerPool
from mileage.rollout.journal import ToolJournal

JOURNAL_NAME = "opd_teacher"


def _ids_digest(ids: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


def _reply_checker(ids: list[int], start: int) -> Callable[[Any], list[float]]:
    """The log-probs of ids[start+1:] from a reply, or BadReply naming what is wrong."""

    def check(reply: Any) -> list[float]:
        if isinstance(reply, list) and len(reply) == 1:
            reply = reply[0]
        meta = reply.get("meta_info") if isinstance(reply, dict) else None
        rows = meta.get("input_token_logprobs") if isinstance(meta, dict) else None
        if not isinstance(rows, list) or len(rows) != len(ids) - start:
            raise BadReply(
                f"the reply's meta_info.input_token_logprobs is not {len(ids) - start} "
                f"[log-prob, token id, text] entries"
            )
        values = []
        for i, row in enumerate(rows[1:], start + 1):
            ok = isinstance(row, list) and len(row) >= 2 and row[1] == ids[i]
            value = row[0] if ok else None
            if not (isinstance(value, int | float) and not isinstance(value, bool)):
                raise BadReply(
                    f"input_token_logprobs[{i - start}] is not [log-prob, {ids[i]}, ...]"
                )
            if not (math.isfinite(value) and value <= 0.0):
                raise BadReply(f"input_token_logprobs[{i - start}] holds {value}, not a log-prob")
            values.append(float(value))
        return values

    return check


class ServedTeacher:
    """Teacher log-probs of samples' response tokens from `url`'s `/generate`."""

    def __init__(
        self,
        url: str,
        timeout: float,
        attempts: int,
        journal: ToolJournal,
        temperature: float,
        log: Callable[[str], None] = print,
    ):
        self.pool = ServerPool([url], timeout, attempts, f"the OPD teacher {url}", log)
        self.pool.in_flight = 4  # SGLang batches concurrent requests; mileage serve queues them
        self.journal = journal
        self.temperature = temperature
        self.requests = 0  # sent to the server (the rest came from the journal)

    def score(self, samples: Sequence[Any], slot: int) -> list[list[float]]:
        """Per sample, the teacher's log-prob of each response token (prompt_ids, response_ids)."""
        scores: list[list[float] | None] = []
        missing = []
        for i, sample in enumerate(samples):
            ids = [*sample.prompt_ids, *sample.response_ids]
            entry = self.journal.get(slot, self._key(i))
            if entry is not None and entry.get("ids") == _ids_digest(ids):
                scores.append(entry["logprobs"])
            else:
                scores.append(None)
                missing.append(i)
        if missing:
            payloads, checks = [], []
            for i in missing:
                s = samples[i]
                ids = [*s.prompt_ids, *s.response_ids]
                # from the last prompt token on: its logits score the first response token
                start = len(s.prompt_ids) - 1
                payloads.append(
                    {
                        "input_ids": ids,
                        "sampling_params": {"max_new_tokens": 0, "temperature": self.temperature},
                        "return_logprob": True,
                        "logprob_start_len": start,
                    }
                )
                checks.append(_reply_checker(ids, start))
            self.requests += len(payloads)
            answers = self.pool.map("/generate", payloads, checks)
            entries = []
            for i, values in zip(missing, answers, strict=True):
                s = samples[i]
                scores[i] = values
                ids_key = _ids_digest([*s.prompt_ids, *s.response_ids])
                entries.append({"key": self._key(i), "ids": ids_key, "logprobs": values})
            self.journal.record_batch(slot, entries)  # before training uses them
        return scores  # type: ignore[return-value]

    @staticmethod
    def _key(sample_index: int) -> str:
        return f"{JOURNAL_NAME}/{sample_index}"
