"""Rule-based rewards with miles' names and meaning: exact, math, dapo, deepscaler, f1.

Each is `fn(prompt, response, label) -> float`. Symbolic equivalence (`1/2` == `0.5` ==
`\\frac{1}{2}`, `x+1` == `1+x`) is decided by `math-verify`, the verifier TRL and open-r1 use.

What each returns (as in miles' rm_hub):
- exact: 1 if the stripped response equals the stripped label, else 0 (mileage's own).
- math: the last \\boxed{} of the response against the label (its own last \\boxed{} if it has
  one): 1 if equal as strings or equivalent under math-verify, else 0. No box: 0.
- deepscaler: like math, but only on the text after the last `</think>` (or after
  `###Response`); a response with neither marker gets 0.
- dapo: the last `Answer: X` line in the response's final 300 characters, normalised, against
  the normalised label (an integer when it reads as a number): 1.0 if equal, else -1.0.
- f1: SQuAD token F1 of response against label after lower-casing and removing punctuation,
  articles and extra whitespace; a yes/no/noanswer on either side must match exactly.
"""

from __future__ import annotations

import re
import string
import threading
from collections import Counter


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, honouring nested braces; None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def exact_reward(prompt: str, response: str, label: str) -> float:
    return float(response.strip() == label.strip())


def answers_equivalent(given: str, reference: str) -> bool:
    """Same string after stripping, or the same value to math-verify."""
    given, reference = given.strip(), reference.strip()
    if not given or not reference:
        return False
    if given == reference:
        return True
    from math_verify import parse, verify

    # math-verify bounds its work with SIGALRM, which only the main thread may set
    limit = 5 if threading.current_thread() is threading.main_thread() else None
    # inside \boxed{} math-verify reads LaTeX and plain expressions alike ("1/2", "\frac12")
    gold = parse(f"\\boxed{{{reference}}}", parsing_timeout=limit)
    target = parse(f"\\boxed{{{given}}}", parsing_timeout=limit)
    return bool(gold and target and verify(gold, target, timeout_seconds=limit))


def grade_answer(answer: str, label: str) -> float:
    """`math` on an already extracted answer (the `boxed_math` comparator)."""
    reference = last_boxed(label) if "\\boxed" in label else label
    return float(reference is not None and answers_equivalent(answer, reference))


def math_reward(prompt: str, response: str, label: str) -> float:
    boxed = last_boxed(response)
    return 0.0 if boxed is None else grade_answer(boxed, label)


def deepscaler_reward(prompt: str, response: str, label: str) -> float:
    if "</think>" in response:
        solution = response.rsplit("</think>", 1)[1]
    elif "###Response" in response:
        solution = response.split("###Response")[1]
    else:
        return 0.0
    return math_reward(prompt, solution, label)


_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_UNIT_WORDS = re.compile(
    r"\b(?:units?|degrees?|cm|meters?|inches|feet|hours?|minutes?|dollars?|cents?|points?)\b"
    r"|\^\\circ|\^\{\\circ\}|\\%|\\!|\\;|\\,"
)
_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|overline|boxed)\{(.*?)\}")


def normalize_final_answer(answer: str) -> str:
    """Minerva-style normalisation: the part after the last '=', no TeX wrappers, units, '$' or
    spaces; thousands separators dropped from plain integers."""
    answer = answer.split("=")[-1]
    answer = _WRAPPERS.sub(r"\1", answer)
    answer = _UNIT_WORDS.sub("", answer)
    answer = answer.replace("$", "").replace(" ", "").rstrip(".")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def _integer_form(normalised: str) -> str:
    """DAPO's labels are integers: "12.0" -> "12"; a label that is no number stays as it is."""
    try:
        return str(int(float(normalised)))
    except (ValueError, OverflowError):
        return normalised


def grade_dapo(answer: str | None, label: str) -> float:
    """`dapo` on an already extracted answer: 1.0 if it matches the label, else -1.0."""
    if answer is None:
        return -1.0
    expected = _integer_form(normalize_final_answer(label))
    return 1.0 if normalize_final_answer(answer) == expected else -1.0


def dapo_reward(prompt: str, response: str, label: str) -> float:
    # only the tail counts, as in DAPO: the answer line is the last thing a solution writes
    found = _ANSWER_LINE.findall(response[-300:])
    return grade_dapo(found[-1] if found else None, label)


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_CLOSED_ANSWERS = ("yes", "no", "noanswer")


def normalize_text(text: str) -> str:
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def f1_reward(prompt: str, response: str, label: str) -> float:
    got, want = normalize_text(response), normalize_text(label)
    if (got in _CLOSED_ANSWERS or want in _CLOSED_ANSWERS) and got != want:
        return 0.0
    common = sum((Counter(got.split()) & Counter(want.split())).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(got.split()), common / len(want.split())
    return 2 * precision * recall / (precision + recall)


def _boxed(grade):
    """The `boxed_` form of a reward: grade only the content of the response's last \\boxed{}
    (an empty answer when there is none), with the reward's own comparison."""

    def reward(prompt: str, response: str, label: str) -> float:
        return grade(prompt, last_boxed(response) or "", label)

    return reward


RULES = {
    "exact": exact_reward,
    "math": math_reward,
    "dapo": dapo_reward,
    "deepscaler": deepscaler_reward,
    "f1": f1_reward,
}
# After the box is taken, math and deepscaler have nothing left to extract: they compare the
# content itself. dapo compares it as its answer line.
BOXED = {
    "boxed_exact": _boxed(exact_reward),
    "boxed_math": _boxed(lambda p, answer, label: grade_answer(answer, label)),
    "boxed_deepscaler": _boxed(lambda p, answer, label: grade_answer(answer, label)),
    "boxed_dapo": _boxed(lambda p, answer, label: grade_dapo(answer or None, label)),
    "boxed_f1": _boxed(f1_reward),
}
