"""On-policy distillation (OPD), with slime's and miles' flags: the student samples, a frozen
teacher scores each sampled token, and every response token's advantage gets
-opd_kl_coef * (log p_student - log p_teacher) on top of whatever the estimator gave it.

The difference is the sampled (k1) estimate of the reverse KL from student to teacher at that
position; subtracting it pushes the student toward tokens the teacher finds likelier than it
does. It is added after the estimator, so it composes with GRPO, REINFORCE++ and PPO alike;
with rewards that carry no signal (all equal in a group) it is pure distillation. Both
log-probs are at the rollout temperature, the student's being the old policy's, the one that
sampled (as slime's `log_probs`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from mileage.checkpoint.sources import Source, teacher_source
from mileage.config import option
from mileage.errors import UserError
from mileage.models.hf import load_tokenizer
from mileage.rollout.engines.http import BadReply, describe, get_json

# where the teacher runs: in the trainer, loaded and sharded like the reference model (miles'
# "megatron": mileage's trainer is torch FSDP2, so the name says so), or behind SGLang's
# /generate (SGLang, or `mileage serve`)
IN_TRAINER, SERVED = "fsdp", "sglang"
OPD_TYPES = (IN_TRAINER, "megatron", SERVED)


@dataclass
class OpdConfig:
    use_opd: bool = option(
        False,
        "on-policy distillation: subtract --opd-kl-coef * (student - teacher log-prob) from "
        "each response token's advantage (docs/distillation.md)",
    )
    opd_type: str | None = option(
        None,
        f"where the teacher runs: {IN_TRAINER} (in the trainer, from --opd-teacher-load, sharded "
        f"like the reference under torchrun) or {SERVED} (a server at --opd-teacher-url: SGLang "
        "or `mileage serve`)",
        choices=OPD_TYPES,
    )
    opd_kl_coef: float = option(1.0, "weight of the distillation term in the advantage")
    opd_teacher_load: str | None = option(
        None,
        "the teacher: a Hugging Face model directory, or a mileage checkpoint directory (its "
        "tracker's iteration, or --opd-teacher-ckpt-step)",
    )
    opd_teacher_ckpt_step: int | None = option(
        None, "the iteration of a checkpoint directory --opd-teacher-load names"
    )
    opd_teacher_url: str | None = option(
        None, f"--opd-type {SERVED}: the teacher server's base URL (its /generate scores tokens)"
    )
    opd_teacher_timeout: float = option(
        120.0, "seconds one teacher request may take before it is retried"
    )
    opd_teacher_attempts: int = option(
        3, "tries of each teacher request before the run stops (exit 2, nothing lost)"
    )

    def validate(self) -> None:
        """The flags together, as slime checks them, before anything loads."""
        if not self.use_opd:
            given = [
                flag
                for flag, value in (
                    ("--opd-type", self.opd_type),
                    ("--opd-teacher-load", self.opd_teacher_load),
                    ("--opd-teacher-ckpt-step", self.opd_teacher_ckpt_step),
                    ("--opd-teacher-url", self.opd_teacher_url),
                )
                if value is not None
            ]
            if given:
                raise UserError(f"{', '.join(given)} given without --use-opd")
            return
        if self.opd_type is None:
            raise UserError(
                f"--use-opd needs --opd-type ({IN_TRAINER}: a teacher in the trainer; {SERVED}: "
                "a teacher server)"
            )
        if self.opd_type == "megatron":
            raise UserError(
                "--opd-type megatron: mileage trains with torch FSDP2, not Megatron; the "
                f"teacher in the trainer is --opd-type {IN_TRAINER}"
            )
        if self.opd_type == SERVED:
            if not self.opd_teacher_url:
                raise UserError(f"--opd-type {SERVED} needs --opd-teacher-url URL")
            if self.opd_teacher_load or self.opd_teacher_ckpt_step is not None:
                raise UserError(
                    f"--opd-type {SERVED} scores on the server at --opd-teacher-url; "
                    "--opd-teacher-load and --opd-teacher-ckpt-step are for --opd-type "
                    f"{IN_TRAINER}"
                )
        elif not self.opd_teacher_load:
            raise UserError(f"--opd-type {IN_TRAINER} needs --opd-teacher-load DIR")
        elif self.opd_teacher_url:
            raise UserError(f"--opd-teacher-url is for --opd-type {SERVED}")
        if self.opd_teacher_timeout <= 0 or self.opd_teacher_attempts < 1:
            raise UserError("--opd-teacher-timeout must be > 0 and --opd-teacher-attempts >= 1")
        if self.opd_kl_coef < 0:
            raise UserError(f"--opd-kl-coef must be >= 0, got {self.opd_kl_coef}")

    def settings(self) -> tuple[tuple[str, object], ...]:
        """What a resume must find unchanged for the same trajectory (only with --use-opd, so
        other runs' meta.json stays as it was)."""
        if not self.use_opd:
            return ()
        return (
            ("--opd-kl-coef", self.opd_kl_coef),
            ("--opd-teacher-load", self.opd_teacher_load),
            ("--opd-teacher-ckpt-step", self.opd_teacher_ckpt_step),
        )


def distill_advantages(
    advantages: torch.Tensor,
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
) -> tuple[torch.Tensor, float]:
    """(advantages - coef * (student - teacher) on the response tokens, the mean of
    student - teacher over them: the sampled reverse KL that metrics.jsonl logs as
    `opd_reverse_kl`). All [N, T] in target space."""
    reverse_kl = (student_logprobs - teacher_logprobs) * mask
    tokens = float(mask.sum())
    mean = float(reverse_kl.sum()) / tokens if tokens else 0.0
    return advantages - coef * reverse_kl, mean


def plan_teacher(
    cfg: OpdConfig, student_tokenizer, student_from: str, model_config: dict | None
) -> tuple[Source | None, str]:
    """(the teacher's weights, or None for a served teacher; the plan's line), refused before
    anything loads when the path is not a model, a native teacher is another architecture, a
    served one does not answer, or the teacher's tokenizer is not the student's (the teacher
    scores the student's token ids)."""
    if cfg.opd_type == SERVED:
        return None, served_teacher_line(cfg, student_tokenizer, student_from)
    source = teacher_source(cfg.opd_teacher_load, cfg.opd_teacher_ckpt_step, model_config)
    if source.fmt == "hf":
        tokenizer_dir = source.path
    else:  # a native checkpoint records the model directory its run started from
        recorded = source.info.meta.get("model_source", {}).get("hf_checkpoint")
        tokenizer_dir = recorded if recorded and os.path.isdir(recorded) else None
    if tokenizer_dir is not None:
        problem = tokenizer_difference(student_tokenizer, load_tokenizer(tokenizer_dir))
        if problem:
            raise UserError(
                f"--opd-teacher-load {cfg.opd_teacher_load} has another tokenizer ({tokenizer_dir}) "
                f"than the student ({student_from}): {problem}; the teacher scores the student's "
                "token ids, so both must share one"
            )
    where = source.fmt + (f", iteration {source.iteration}" if source.iteration is not None else "")
    line = (
        f"teacher: {source.path} ({where}), in the trainer; each response token's advantage "
        f"-= {cfg.opd_kl_coef:g} x (student - teacher log-prob)"
    )
    return source, line


def served_teacher_line(cfg: OpdConfig, student_tokenizer, student_from: str) -> str:
    """The plan's line for the server at --opd-teacher-url, which must answer /get_model_info;
    where the model directory it names is on this machine, its tokenizer must be the student's."""
    url = cfg.opd_teacher_url.rstrip("/")
    try:
        info = get_json(url + "/get_model_info", min(cfg.opd_teacher_timeout, 30.0))
    except (OSError, BadReply) as exc:
        raise UserError(
            f"--opd-teacher-url {url}: no answer from /get_model_info ({describe(exc)}); start "
            "the teacher server first"
        ) from None
    path = (
        (info.get("tokenizer_path") or info.get("model_path")) if isinstance(info, dict) else None
    )
    checked = ""
    if isinstance(path, str) and os.path.isdir(path):
        problem = tokenizer_difference(student_tokenizer, load_tokenizer(path))
        if problem:
            raise UserError(
                f"--opd-teacher-url {url} serves {path}, whose tokenizer is not the student's "
                f"({student_from}): {problem}; the teacher scores the student's token ids"
            )
        checked = f" {path}, tokenizer checked"
    return (
        f"teacher: {url}{checked} (served, SGLang /generate scoring, journaled); each response "
        f"token's advantage -= {cfg.opd_kl_coef:g} x (student - teacher log-prob)"
    )


def tokenizer_difference(student, teacher) -> str:
    """'' when both map every token to the same id and end sequences alike, else what differs."""
    a, b = student.get_vocab(), teacher.get_vocab()
    if a != b:
        differ = sorted(t for t in a.keys() | b.keys() if a.get(t) != b.get(t))
        return f"{len(differ)} token(s) differ, e.g. {differ[0]!r} ({a.get(differ[0])} vs {b.get(differ[0])})"
    if student.eos_token_id != teacher.eos_token_id:
        return f"end-of-sequence ids differ ({student.eos_token_id} vs {teacher.eos_token_id})"
    return ""
