"""The paper's two prompts, rendered through the tokenizer's chat template.

Both go in as one user message with the generation prompt appended (docs/paper.md,
"Prompts"). The Parallel Thinking prompt is used for teacher generation, training and
evaluation; the Baseline prompt for the prompt ablation and the plain GRPO baselines.
"""

from __future__ import annotations

from typing import Literal

from parallel_r1.errors import PipelineError
from parallel_r1.format import TAG_PATTERN

PromptStyle = Literal["parallel", "baseline"]

PARALLEL_THINKING_PROMPT = """Solve the following problem step by step.
During the reasoning process, whenever you encounter a step that may benefit from multiple perspectives or independent reasoning, insert a parallel block at that point.

Within each parallel block:
Begin the block with <Parallel>.
Include at least two distinct and independent reasoning paths.
Each path must be enclosed within <Path> and </Path> tags.
Do not include any ordering information or cross-references between paths, as they are generated simultaneously and independently.
Close the block with </Parallel>.
Immediately after each </Parallel>, write a concise summary of insights or conclusions drawn from all paths, enclosed in <Summary> and </Summary> tags.

Repeat this process adaptively as needed throughout the reasoning.
Do not explicitly mention that you are triggering parallel thinking—just insert the parallel block naturally within the reasoning chain.

End your response with a line starting with Final Answer: followed by the final result.

Problem: {Problem}"""  # noqa: E501 (the paper's prompt, verbatim: its lines are the text, not code)

BASELINE_PROMPT = '{Problem} Let\'s think step by step and output the final answer after "Final Answer: ".'

_TEMPLATES = {"parallel": PARALLEL_THINKING_PROMPT, "baseline": BASELINE_PROMPT}

# A tag inside a question is text, not structure: a zero-width space after its `<` keeps it readable
# but stops the tokenizer from matching the special control token, which the rollout engine forks at
# and the structured mask reads. Escaped rather than rejected: a public dataset row stays usable.
TAG_ESCAPE = "<\u200b"


def escape_tags(question: str) -> str:
    """`question` with every parallel tag (`<Path>`, `</Summary>`, ...) escaped as plain text."""
    return TAG_PATTERN.sub(lambda match: TAG_ESCAPE + match.group()[1:], question)


def user_message(question: str, style: PromptStyle = "parallel") -> str:
    """The user turn for `question` in the given prompt style."""
    if style not in _TEMPLATES:
        raise PipelineError(f"prompt style {style!r} is unknown (choose from {', '.join(_TEMPLATES)})")
    if not question or not question.strip():
        raise PipelineError("prompt: empty question")
    return _TEMPLATES[style].replace("{Problem}", escape_tags(question.strip()))


def chat_messages(question: str, style: PromptStyle = "parallel") -> list[dict[str, str]]:
    """The conversation TRL and the chat template expect: a single user message."""
    return [{"role": "user", "content": user_message(question, style)}]


def render_prompt(tokenizer, question: str, style: PromptStyle = "parallel") -> str:
    """The prompt text as the model sees it: chat template plus generation prompt."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise PipelineError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template")
    return tokenizer.apply_chat_template(
        chat_messages(question, style), tokenize=False, add_generation_prompt=True
    )


def end_of_turn_ids(tokenizer) -> frozenset[int]:
    """The token that closes an assistant turn in the tokenizer's chat template (Qwen: `<|im_end|>`).

    Read off the template itself -- a one-turn conversation is rendered and the first token after
    the assistant's text is taken when it is a special token -- so it holds for any init model,
    including a base model whose EOS is `<|endoftext|>`. Empty when there is no chat template.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        return frozenset()
    mark = "END-OF-TURN-PROBE"
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": mark}]
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    if mark not in text:
        return frozenset()
    after = tokenizer(text[text.rindex(mark) + len(mark):], add_special_tokens=False)["input_ids"]
    return frozenset(after[:1]) & frozenset(tokenizer.all_special_ids)
