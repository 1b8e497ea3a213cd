"""The causal LM offload-train trains: the built-in decoder, or a local Hugging Face model.

Either way the model is built with its parameters on the meta device and materialised by the
engine into their homes; a Hugging Face model then gets its weights from the directory's
safetensors shards, streamed into the shards one stored tensor (or one fused parameter) at a time,
through the same name and layout conversion `from_pretrained` applies (app/hf_weights.py: Mixtral's
per-expert tensors become its fused expert parameters, say). It brings its tokenizer when the
directory has one (byte-level tokens otherwise, which the run says: byte_tokens_note). With [lora] on, either model is wrapped with PEFT
adapters (app/lora.py) before the engine takes it. The loss is the same for all: cross entropy of
the logits against the next tokens, skipping the targets the data marks IGNORE_INDEX (chat
prompts). Export writes model.safetensors, and for a Hugging Face model a directory
`from_pretrained` loads, through the model's and tokenizer's own save_pretrained
(app/hf_export.py), with the weights streamed in the layout `save_pretrained` writes for that
architecture; or the adapters alone.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

from io_engine.atomic_dir import atomic_dir

from offload_trainer.app.run_config import RunConfig
from offload_trainer.config import ComputeDtype
from offload_trainer.app.data import IGNORE_INDEX, ByteTokenizer, HFTokenizer, Tokenizer
from offload_trainer.app.hf_export import write_hf_files
from offload_trainer.app.lora import LoraModel
from offload_trainer.app.run_config import LoraExport
from offload_trainer.app.hf_weights import HFCheckpoint, hf_weight_files
from offload_trainer.runtime.persist.export import StoredAs
from offload_trainer.runtime.persist.materialize import parameters_on_meta
from offload_trainer.runtime.persist.safetensors_load import WeightSource, check_weights_fit
from offload_trainer.models.decoder import DecoderConfig, DecoderLM, init_weights
from offload_trainer.models.hf_checkpointing import enable_hf_checkpointing
from offload_trainer.models.meta_init import on_meta, skipping_meta_init

if TYPE_CHECKING:
    from offload_trainer.runtime.engine import Engine

def zero_init(module: nn.Module) -> None:
    """Placeholder initialisation for weights that are loaded from files right after."""
    for p in module._parameters.values():
        if p is not None:
            p.data.zero_()


@dataclass
class CausalLM:
    model: nn.Module
    init_fn: Callable[[nn.Module], None]
    tokenizer: Tokenizer
    weight_files: Union[List[Path], WeightSource]
    """What engine.load_safetensors loads after initialize: safetensors shards, or a source that
    converts a checkpoint's layout (a Hugging Face model's weights: an HFCheckpoint); empty for none."""
    hf_dir: Optional[Path]
    stored_as: Optional[StoredAs] = None
    """How export stores the parameters (a Hugging Face model's on-disk layout); the model's names if None."""

    hf_tokenizer: Any = None
    """The Hugging Face tokenizer export saves (with its chat template), if the model brought one."""
    lora: Optional[LoraModel] = None
    """The adapters, when [lora] is on (then `model` is PEFT's wrapped model)."""
    export_adapter: bool = False
    """Export the adapters alone (lora.export = "adapter") instead of the merged model."""

    restart_positions: bool = True
    """Whether loss() gives a Hugging Face model the batches' position ids (packed_attention.py turns it
    off for a model whose attention does not restart with them)."""

    def loss(
        self, engine: "Engine", inputs: torch.Tensor, targets: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """The loss of one micro-batch; `inputs`, `targets` and `position_ids` (the data's Batch) are host
        tensors, taken to the engine's device here (the model's parameters are there). A Hugging Face
        model runs with use_cache=False, as hf_block_stack's layer-major step does: its default (the
        config's use_cache, True for most) built a key/value cache of every layer in each forward, which
        a loss never reads and which, in the eval's no_grad forward, kept every layer's keys and values
        alive to its end; and with a cache transformers makes no packed-sequence mask from position ids
        restarting at each conversation (chat data's), so the conversations packed into a row would
        attend to each other. The built-in decoder takes no chat data (its tokens are bytes), so no
        position ids."""
        if self.hf_dir is None:
            return self.loss_of(engine(to_device(inputs, engine.device)), targets)
        kwargs: Dict[str, Any] = {"use_cache": False}
        if position_ids is not None and self.restart_positions:
            kwargs["position_ids"] = to_device(position_ids, engine.device)
        return self.loss_of(engine(to_device(inputs, engine.device), **kwargs), targets)

    @staticmethod
    def loss_of(out: object, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy of the model's output (logits, or an output with .logits) against the next
        tokens, over the targets that are not IGNORE_INDEX (chat prompts); a batch with none gives a zero
        loss that still reaches every parameter of the graph. `targets` may be on the host: they go to
        the logits' device (the all-ignored test is made first, on the host, with no wait for the GPU)."""
        logits = out.logits if hasattr(out, "logits") else out  # type: ignore[attr-defined]
        if bool((targets == IGNORE_INDEX).all()):
            return logits.float().sum() * 0.0
        targets = to_device(targets, logits.device)
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)

    def export_target(self, out_dir: Path) -> Path:
        """Where export() writes: out_dir/adapter, out_dir/model.safetensors or out_dir/hf."""
        if self.lora is not None and self.export_adapter:
            return out_dir / "adapter"
        return out_dir / "model.safetensors" if self.hf_dir is None else out_dir / "hf"

    def export(self, engine: "Engine", out_dir: Path, export_dtype: str) -> Path:
        """The model (or adapters) in `export_dtype`, written where `from_pretrained` loads it: a Hugging Face
        model's directory out_dir/hf through its own save_pretrained (app/hf_export.py), the built-in
        decoder's out_dir/model.safetensors, or the adapters' out_dir/adapter. A directory is written
        as a whole (io_engine/atomic_dir.py): a kill at any moment leaves the previous export or this
        one, never a mix of their files. Collective; rank 0 writes."""
        dtype = ComputeDtype(export_dtype).torch_dtype
        rank = engine.collectives.rank
        target = self.export_target(out_dir)
        adapter = self.lora is not None and self.export_adapter
        if self.hf_dir is None and not adapter:  # one file, atomic itself
            return engine.export_safetensors(target, dtype, stored_as=self._merged_stored_as())
        with atomic_dir(target) if rank == 0 else contextlib.nullcontext(target) as into:
            if adapter:
                if rank == 0:
                    write_hf_files(into, tokenizer=self.hf_tokenizer, peft_model=self.lora.model)
                engine.export_safetensors(into / "adapter_model.safetensors", dtype, stored_as=self.lora.adapter_only)
            else:
                if rank == 0:
                    base = self.model if self.lora is None else self.lora.model.get_base_model()
                    write_hf_files(into, model=base, dtype=dtype, tokenizer=self.hf_tokenizer, came_with=self.hf_dir)
                engine.export_safetensors(into / "model.safetensors", dtype, stored_as=self._merged_stored_as())
        return target

    def _merged_stored_as(self) -> Optional[StoredAs]:
        """How the whole model's weights are stored: the model's layout, with LoRA's adapters merged in."""
        return self.stored_as if self.lora is None else self.lora.merged(self.stored_as)


def mean_on_host(losses: Sequence[torch.Tensor]) -> float:
    """The mean of `losses` (scalars on the device), summed there in float64 in order (the sums a
    Python float makes) and read on the host once: a float() of each made the host wait on a GPU for
    the work queued behind it (a micro-batch's whole backward) before it could issue more. NaN for none."""
    if not losses:
        return float("nan")
    total = losses[0].detach().to(torch.float64)
    for loss in losses[1:]:
        total = total + loss.detach().to(torch.float64)
    return float(total) / len(losses)


def to_device(batch: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host batch (the data's token ids) on the engine's device (as it is, on the CPU). On a GPU
    through pinned memory, without blocking: a blocking copy from pageable memory waits for all the
    work queued on the stream (the previous micro-batch's backward) before the host can go on, and
    the step reads its losses once, after step() (train_step). The pinned copy stays reserved by
    torch's caching host allocator until the copy has run, so it may be dropped at once."""
    if device.type != "cuda" or batch.device.type != "cpu":
        return batch.to(device)
    return batch.pin_memory().to(device, non_blocking=True)


def build_causal_lm(cfg: RunConfig) -> CausalLM:
    if cfg.model.hf_path is None:
        mcfg = DecoderConfig.preset(cfg.model.preset, max_seq_len=max(cfg.data.seq_len, 1))
        with on_meta():
            model = DecoderLM(mcfg, activation_checkpointing=cfg.model.activation_checkpointing)
        tokenizer: Tokenizer = ByteTokenizer()
        _check_vocab(mcfg.vocab_size, tokenizer, f"model.preset={cfg.model.preset!r}")
        return _with_lora(CausalLM(model, init_weights, tokenizer, [], None), cfg, causal_lm=False)
    lm = _with_lora(_hugging_face(Path(cfg.model.hf_path), cfg), cfg, causal_lm=True)
    check_weights_fit(lm.model, _as_source(lm.weight_files))  # on meta: nothing is built for weights that misfit
    return lm


def _with_lora(lm: CausalLM, cfg: RunConfig, causal_lm: bool) -> CausalLM:
    """`lm` with PEFT LoRA adapters when [lora] is on (lora.rank > 0)."""
    if not cfg.lora.enabled:
        return lm
    lora = LoraModel.wrap(lm.model, cfg.lora, cfg.seed, causal_lm=causal_lm)
    weights = lm.weight_files if not lm.weight_files else lora.weights(_as_source(lm.weight_files))
    return CausalLM(
        lora.model, lora.init_fn(lm.init_fn), lm.tokenizer, weights, lm.hf_dir, lm.stored_as, lm.hf_tokenizer,
        lora=lora, export_adapter=cfg.lora.export is LoraExport.ADAPTER,
    )


def _as_source(weights: Union[List[Path], WeightSource]) -> WeightSource:
    from offload_trainer.runtime.persist.safetensors_load import SafetensorsFiles

    return weights if isinstance(weights, WeightSource) else SafetensorsFiles(weights)


def _hugging_face(path: Path, cfg: RunConfig) -> CausalLM:
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise ValueError(
            "model.hf_path needs the transformers package: pip install 'offload-trainer[hf]'"
        ) from None
    if not (path / "config.json").is_file():
        raise ValueError(f"model.hf_path={str(path)!r} is not a Hugging Face model directory (no config.json there)")
    weights = hf_weight_files(path)
    if not weights:
        raise ValueError(
            f"model.hf_path={str(path)!r} has no *.safetensors weights; convert the checkpoint to safetensors "
            "(model.save_pretrained(dir) writes them)"
        )
    # The library's log lines (a config it cannot validate, a tokenizer it patches) went straight to stderr, a
    # second line beside a refusal's one: through library_warnings_as_python_warnings, as building the model does.
    with library_refusal(f"model.hf_path={str(path)!r}: its config.json cannot be built into a causal LM", path):
        with library_warnings_as_python_warnings():
            hf_config = AutoConfig.from_pretrained(path)
    # The model's name_or_path, which PEFT writes into an adapter export's adapter_config.json as
    # base_model_name_or_path: absolute, so AutoPeftModelForCausalLM finds the base from any directory. As
    # given ("my-llama" under a relative model.hf_path), it was looked up as a Hub name from elsewhere.
    hf_config.name_or_path = str(path.resolve())
    _check_positions(hf_config, path, cfg.data.seq_len)
    with library_refusal(f"model.hf_path={str(path)!r}: its config.json cannot be built into a causal LM", path):
        with parameters_on_meta(), skipping_meta_init(), library_warnings_as_python_warnings():
            model = AutoModelForCausalLM.from_config(hf_config, **_fp32_kwargs())
    refuse_non_causal(model, f"model.hf_path={str(path)!r}")
    checkpoint = HFCheckpoint(model, weights)  # reads headers only; the engine loads it after initialize
    checkpoint.load_buffers()  # persistent buffers, if the files hold any, before initialize moves them
    if cfg.model.activation_checkpointing:
        enable_hf_checkpointing(model)
    has_tokenizer = any((path / n).is_file() for n in TOKENIZER_FILES)
    hf_tokenizer = None
    if has_tokenizer:
        with library_refusal(f"model.hf_path={str(path)!r}: its tokenizer files cannot be loaded", path):
            with library_warnings_as_python_warnings():
                hf_tokenizer = AutoTokenizer.from_pretrained(path)
    what = f"the tokenizer of model.hf_path={str(path)!r}"
    tokenizer: Tokenizer = HFTokenizer(hf_tokenizer, what, files=path) if hf_tokenizer is not None else ByteTokenizer()
    _check_vocab(model.get_input_embeddings().num_embeddings, tokenizer, f"model.hf_path={str(path)!r}")
    return CausalLM(
        model, zero_init, tokenizer, checkpoint, path, stored_as=checkpoint.stored_as, hf_tokenizer=hf_tokenizer
    )


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
"""The files whose presence in model.hf_path means it brings a tokenizer (AutoTokenizer loads it)."""


def byte_tokens_note(lm: CausalLM) -> Optional[str]:
    """A line saying a Hugging Face model trains on UTF-8 bytes (its directory has no tokenizer files),
    or None. A pretrained model's embeddings stand for its own tokenizer's ids, so byte ids 0-255 are
    almost surely a mistake (a tokenizer not copied along with the weights); for a model made from a
    config (pretraining from scratch, a test model) they are a choice, so this is a note, not a refusal."""
    if lm.hf_dir is None or lm.hf_tokenizer is not None:
        return None
    files = ", ".join(TOKENIZER_FILES)
    return (
        f"model.hf_path={str(lm.hf_dir)!r} has no tokenizer files ({files}): training on UTF-8 bytes "
        "(token ids 0-255), not the ids a pretrained model's embeddings stand for; copy its tokenizer files there"
    )


def _fp32_kwargs() -> Dict[str, torch.dtype]:
    """from_config's argument that builds the model in fp32. Without it transformers builds it in the
    dtype config.json records (bf16 for most checkpoints published), which the engine refuses: it keeps
    fp32 parameters and computes in precision.compute_dtype. The stored weights are cast to fp32 on load
    (exact from bf16 and fp16). transformers 5 (and 4.56+) call the argument `dtype`, older ones `torch_dtype`."""
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": torch.float32}


@contextlib.contextmanager
def library_refusal(what: str, path: Path) -> Iterator[None]:
    """What transformers raises on a model directory's own files (a config value of the wrong type, an
    unknown model_type, a tokenizer.json that is not JSON: ValueError, TypeError, KeyError, OSError, or
    huggingface_hub's strict-dataclass errors, which are none of these) as one ValueError naming the
    directory and the fix. Only the library's calls on the user's files are wrapped, so a bug of ours
    still shows its traceback."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - the library raises many kinds for one cause: the files
        detail = " ".join(str(exc).split())[:400]
        raise ValueError(
            f"{what} ({type(exc).__name__}: {detail}); fix or replace the files in {path} (save_pretrained "
            "writes them)"
        ) from None


@contextlib.contextmanager
def library_warnings_as_python_warnings() -> Iterator[None]:
    """transformers' logger writes straight to stderr (`BertLMHeadModel` as a standalone...), a second
    line beside a refusal's one; meanwhile its warnings go through Python's warnings instead, which
    offload-train prints after a finished run and drops with an error."""
    from transformers.utils import logging as hf_logging

    logger = hf_logging.get_logger("transformers")
    handler = _ToWarnings()
    saved = logger.handlers[:], logger.propagate
    logger.handlers[:] = [handler]
    logger.propagate = False
    try:
        yield
    finally:
        logger.handlers[:], logger.propagate = saved


class _ToWarnings(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING:
            warnings.warn(f"transformers: {record.getMessage()}", stacklevel=2)


def refuse_non_causal(model: nn.Module, what: str) -> None:
    """ValueError if the attention of `model` (a Hugging Face model, on meta) is not causal. An encoder's
    config (BERT's, RoBERTa's) builds a "causal LM" all the same (BertLMHeadModel, with a warning), whose
    every position sees the tokens it is trained to predict: the loss falls and the model learns nothing
    a decoder could use. Such a model's config says `is_decoder: false` and none of its modules says it is
    causal: transformers marks attention with `is_causal`, and the BERT family's layers (MegatronBERT,
    RemBERT, RoFormer, BigBird have no `is_causal` at all) with `is_decoder`, copied from the config, which
    is what makes them mask the future. Either sign alone is none (Llama's config has is_decoder false, and
    GIT's decoder masks the future without any module's flag: its only `is_causal` is its vision tower's,
    false). A model that says neither is taken as it is. A forward probe (earlier logits unchanged when a
    later token changes) is not made: it needs the weights' values, which a model on meta lacks, and a
    batch-wide router (expert capacity) would fail it in a causal model. offload-train and offload-plan
    both ask here, so they agree."""
    flags = [
        getattr(m, name) for m in model.modules() for name in ("is_causal", "is_decoder")
        if isinstance(getattr(m, name, None), bool)
    ]
    config = getattr(model, "config", None)
    if flags and not any(flags) and getattr(config, "is_decoder", None) is False:
        raise ValueError(
            f"{what} builds {type(model).__name__}, whose attention is not causal (an encoder: each position sees "
            "the tokens it is trained to predict); choose a decoder model, or set \"is_decoder\": true in its "
            "config.json where the architecture has that setting (BERT, RoBERTa, MegatronBERT, RemBERT, "
            "RoFormer, BigBird)"
        )


def _check_positions(hf_config: object, path: Path, seq_len: int) -> None:
    """Refuse sequences longer than the model's position table (learned positions would index past
    it; rotary ones would run past what the model was trained for)."""
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    max_positions = getattr(text_config, "max_position_embeddings", None)
    if isinstance(max_positions, int) and seq_len > max_positions:
        raise ValueError(
            f"data.seq_len={seq_len} is longer than model.hf_path={str(path)!r} allows: its config.json has "
            f"max_position_embeddings={max_positions}; set data.seq_len to at most {max_positions}"
        )


def _check_vocab(model_vocab: int, tokenizer: Tokenizer, what: str) -> None:
    if model_vocab < tokenizer.vocab_size:
        raise ValueError(
            f"{what} has {model_vocab} token embeddings but its tokenizer gives ids up to {tokenizer.vocab_size - 1}, "
            f"which need {tokenizer.vocab_size} (byte-level tokens need 256): use a tokenizer of this model"
        )
