"""Chat documents: a conversation rendered with the tokenizer's own chat template, the loss on the
assistant's tokens alone.

    ids, trained = render_chat(hf_tokenizer, [{"role": "user", "content": "hi"},
                                              {"role": "assistant", "content": "hello"}], "model.hf_path=...")

Which characters are the assistant's is learned from the template itself, not from marker strings:
for each assistant message k, the conversation up to k rendered with the generation prompt (what a
model is given before it answers) must be a prefix of the conversation up to and including k; the
characters between the two are the reply and what the template ends it with (`<|im_end|>`, `</s>`).
The text is tokenized in pieces cut at those boundaries, so no token straddles prompt and reply.
"""

from __future__ import annotations

import difflib
from typing import Any, List, Mapping, Optional, Sequence, Tuple


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], what: str) -> Tuple[List[int], List[bool]]:
    """(token ids, trained per token) of one conversation; ValueError naming the fix if the tokenizer
    has no chat template or the template does not render conversations as prefixes of each other."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"chat documents (\"messages\") need a tokenizer with a chat template, and {what} has none: "
            "use a model whose tokenizer_config.json has a \"chat_template\", or give plain \"text\" documents"
        )
    template = tokenizer.chat_template
    if not isinstance(template, (str, Mapping)):  # a dict: several named templates, as transformers keeps them
        # jinja2's own words were the whole line: "Can't compile non template nodes", naming no file
        raise ValueError(
            f"the chat template of {what} is {template!r:.60}, not a Jinja template's text: fix \"chat_template\" "
            "in its tokenizer_config.json (or chat_template.jinja)"
        )
    messages = [dict(m) for m in messages]
    try:
        from jinja2 import TemplateError  # transformers renders chat templates with jinja2
    except ImportError:  # not a dependency of transformers: apply_chat_template says to install it
        TemplateError = ()  # type: ignore[assignment, misc]  # an except clause that catches nothing

    def render(upto: int, generation_prompt: bool, conversation: Sequence[Mapping[str, Any]] = messages) -> str:
        try:
            return tokenizer.apply_chat_template(
                list(conversation[:upto]), tokenize=False, add_generation_prompt=generation_prompt
            )
        except TemplateError as exc:
            # A template that is not jinja2, or one refusing the conversation itself (raise_exception("Conversation
            # roles must alternate user/assistant/...")): a traceback before, naming neither the model nor the fix.
            raise ValueError(
                f"the chat template of {what} cannot render this conversation ({type(exc).__name__}: "
                f"{' '.join(str(exc).split())[:300]}): fix the conversation as the template asks, or the template "
                "(\"chat_template\" in tokenizer_config.json, or chat_template.jinja)"
            ) from None

    full = render(len(messages), False)
    spans: List[Tuple[int, int]] = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        upto = render(k + 1, False)
        prompt = render(k, True) if k else ""
        if not upto.startswith(prompt) and k:
            prompt = render(k, False)
        if not (upto.startswith(prompt) and full.startswith(upto)):
            raise ValueError(
                f"the chat template of {what} does not render a conversation's first messages as the start of "
                f"the whole (message {k}, the assistant's): the reply's tokens cannot be told from the prompt's. "
                "Give such data as plain \"text\" documents, or use a template that renders turns in order"
            )
        content = message["content"].strip()
        if not content or content not in upto[len(prompt):]:
            # The reply may have rendered to nothing (empty, blank under a template that trims, or dropped as
            # Qwen3's drops an earlier turn's reasoning): then only the template's end of turn was trained,
            # teaching the model to answer with nothing. Told by rendering the turn with no content at all.
            blank = [*messages[:k], {**message, "content": ""}]
            if render(k + 1, False, blank) == upto:
                raise ValueError(
                    f"the assistant's message {k} renders to no tokens through the chat template of {what} "
                    f"(its content is {message['content']!r:.60}), so only the template's end of turn would be "
                    "trained, teaching the model to answer with nothing: give the reply its text, or remove the "
                    "conversation (or that turn) from the data"
                )
        spans.append((len(prompt), len(upto)))
    cuts = sorted({0, len(full), *(c for span in spans for c in span)})
    ids: List[int] = []
    trained: List[bool] = []
    for start, end in zip(cuts, cuts[1:]):
        # verbose=False: no "will result in indexing errors" warning for a long reply (see HFTokenizer.encode)
        piece = tokenizer(full[start:end], add_special_tokens=False, verbose=False)["input_ids"]
        is_reply = any(s <= start and end <= e for s, e in spans)
        ids.extend(piece)
        trained.extend([is_reply] * len(piece))
    return ids, trained


def check_messages(messages: object, where: str) -> List[Mapping[str, Any]]:
    """A conversation as chat templates take it: a list of {"role": str, "content": str}, one at least
    of them the assistant's. ValueError naming `where` (file:line) and the fix otherwise."""
    fix = 'Each conversation is a list of {"role": "user" | "assistant" | "system", "content": "..."} objects.'
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: \"messages\" is not a non-empty list. {fix}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {i} is {m!r:.80}, without a string role and content. {fix}")
    for i, m in enumerate(messages):
        close = _standard_role_meant(m["role"])
        if close is not None:
            # Only "assistant" turns are trained: an "Assistant" or "asistant" reply was trained as prompt,
            # without a word (a "usr" turn rendered under a role the model never saw).
            raise ValueError(
                f"{where}: message {i} has the role {m['role']!r}; did you mean {close!r}? Roles are matched exactly "
                f"(only \"assistant\" messages are trained on). {fix}"
            )
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(
            f"{where}: the conversation has no \"assistant\" message, so nothing in it is trained on. {fix}"
        )
    return messages  # type: ignore[return-value]


STANDARD_ROLES = ("system", "user", "assistant", "tool")
"""The roles chat templates share. Others ("ipython", "developer", "function") are passed on as they are."""


def _standard_role_meant(role: str) -> Optional[str]:
    """The standard role `role` is a miscased or misspelt form of ("Assistant", "usr"), or None: a standard
    role itself, or a role of its own that is close to none."""
    if role in STANDARD_ROLES:
        return None
    close = difflib.get_close_matches(role.lower(), STANDARD_ROLES, n=1, cutoff=0.75)
    return close[0] if close else None
