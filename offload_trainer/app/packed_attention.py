"""Whether a Hugging Face model keeps the conversations packed into one row apart, given position ids
that restart at each (what chat data's batches carry: packed_dataset.Batch).

    note = check_packed_attention(engine, lm)   # None, or a line saying the model mixes them (and why)

transformers (5, and late 4.x releases) builds the attention mask of most decoders in masking_utils, which,
given position ids and neither an attention mask nor a key/value cache, finds where they restart
(`find_packed_sequence_indices`) and makes the mask block-causal: each conversation attends to itself
alone, its logits those of the conversation alone (1e-7 in fp32 with Llama, Qwen2, GPT-2, GPT-J,
Gemma2, eager and sdpa). A model that builds its mask otherwise (OPT's, or an older transformers)
takes the position ids for its positions alone and still attends across the row: worse than either.
So before the first step one forward of a two-token row is run with restarting positions, in eval
mode under no_grad, with masking_utils' finder replaced by one that records its answer and ends the
forward right there (after the embeddings). A model that never asks is given no position ids: it
trains as before, conversations attending to those before them in their row, and the run says so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional

import torch

if TYPE_CHECKING:
    from offload_trainer.app.causal_lm import CausalLM
    from offload_trainer.runtime.engine import Engine


class _Answered(Exception):
    """Raised by the stand-in finder: the model asked, nothing of the forward past its mask is needed."""


def check_packed_attention(engine: "Engine", lm: "CausalLM") -> Optional[str]:
    """Probe `lm` (a Hugging Face model in `engine`); on a model that does not restart its attention with
    the position ids, turn `lm.restart_positions` off and return the line saying so. Collective: every
    rank runs the same forward."""
    if not restarts_attention(engine):
        lm.restart_positions = False
        import transformers

        return (
            f"{type(lm.model).__name__} ({lm.hf_dir}) under transformers {transformers.__version__} does not build "
            "its attention mask from position ids that restart at each conversation (masking_utils' packed "
            "sequences, which older transformers lack), so the conversations packed into a "
            "sequence attend to those before them in it, as plain text does; Llama, Qwen, Mistral, Gemma, GPT-2 "
            "and most decoders keep them apart"
        )
    return None


def restarts_attention(engine: Any) -> bool:
    """Whether a forward of the engine's model with position ids [[0, 0]] makes transformers find two
    packed sequences (see the module docstring)."""
    try:
        import transformers.masking_utils as masking_utils
    except ImportError:
        return False
    real = getattr(masking_utils, "find_packed_sequence_indices", None)
    if real is None:
        return False
    answers: List[bool] = []

    def finder(position_ids: torch.Tensor) -> Any:
        answers.append(real(position_ids) is not None)
        raise _Answered

    model = engine.model
    was_training = model.training
    device = engine.device
    masking_utils.find_packed_sequence_indices = finder
    model.eval()
    try:
        with torch.no_grad():
            inputs = torch.zeros(1, 2, dtype=torch.long, device=device)
            engine(inputs, position_ids=torch.zeros(1, 2, dtype=torch.long, device=device), use_cache=False)
    except _Answered:
        pass
    finally:
        masking_utils.find_packed_sequence_indices = real
        model.train(was_training)
    return bool(answers) and answers[0]
