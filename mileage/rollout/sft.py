"""Supervised samples: a data record's own answer as the sample `mileage sft` trains on.

Two shapes of record, as miles' SFT takes them:

- a prompt and its response (`--input-key`, `--label-key`): the prompt's ids as a rollout
  encodes them (the chat template's generation prompt with `--apply-chat-template`), then the
  response's ids and the end-of-sequence id; every response token is trained;
- a message list with assistant turns (`--input-key messages`; no label needed): the prompt is
  the messages before the first assistant turn, the rest is the response, and only the
  assistant turns' tokens are trained. Their spans come from rendering the conversation through
  the chat template one message at a time: the tokens a turn adds are its own, and the role
  markers before it (the generation prompt) and the user or tool turns between are not trained.

The loss is `--loss-type sft_loss`: the mean negative log-likelihood of the trained tokens.
"""

from __future__ import annotations

from mileage.errors import UserError
from mileage.rollout.prompts import Prompt
from mileage.rollout.rollout import PromptEncoder
from mileage.rollout.sample import Sample

ASSISTANT = "assistant"


def sft_sample(prompt: Prompt, encode: PromptEncoder, eos_id: int) -> Sample:
    """The supervised sample of `prompt`'s record (its reward 0: nothing scores it)."""
    turns = prompt.messages or []
    first = next((i for i, m in enumerate(turns) if m.get("role") == ASSISTANT), None)
    if first is None:
        if not prompt.label:
            raise UserError(
                f"SFT record {prompt.index} has no response: give it in the --label-key column, "
                "or as assistant turns of a message list"
            )
        prompt_ids = encode.prompt_ids(prompt)
        response = encode.tokenizer(prompt.label, add_special_tokens=False)["input_ids"]
        response_ids = [*response, eos_id]
        mask = [1] * len(response_ids)
    else:
        if first == 0:
            raise UserError(
                f"SFT record {prompt.index}: the conversation starts with an assistant turn"
            )
        prompt_ids, response_ids, mask = _conversation(encode, turns, first, prompt.index)
    return Sample(
        prompt,
        prompt_ids,
        response_ids,
        [0.0] * len(response_ids),
        "",
        0.0,
        True,
        loss_mask=mask,
    )


def _render(encode: PromptEncoder, turns: list[dict], generation_prompt: bool) -> list[int]:
    return list(
        encode.tokenizer.apply_chat_template(
            turns, add_generation_prompt=generation_prompt, tokenize=True, return_dict=False
        )
    )


def _conversation(
    encode: PromptEncoder, turns: list[dict], first: int, index: int
) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, response ids, per-response-token mask) of a conversation whose assistant
    turns start at `first`."""
    if not getattr(encode.tokenizer, "chat_template", None):
        raise UserError(f"SFT record {index} is a message list, which needs a chat template")
    prompt_ids = _render(encode, turns[:first], True)
    ids, mask = list(prompt_ids), []
    for i in range(first, len(turns)):
        assistant = turns[i].get("role") == ASSISTANT
        # an assistant turn's tokens are what it adds after the generation prompt
        before = _render(encode, turns[:i], assistant) if i > first else prompt_ids
        after = _render(encode, turns[: i + 1], False)
        if after[: len(before)] != before or before[: len(ids)] != ids:
            raise UserError(
                f"SFT record {index}: the chat template renders turn {i} differently once more "
                "turns follow, so its tokens cannot be told apart; give prompt/response pairs"
            )
        mask += [0] * (len(before) - len(ids)) + [int(assistant)] * (len(after) - len(before))
        ids = after
    return prompt_ids, ids[len(prompt_ids) :], mask
