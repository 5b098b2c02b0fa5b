"""The memory plan: what one GPU will hold while a run trains, from its config alone, before any process starts.

    python train.py recipe=paper_llama2_70b --plan          # per-GPU terms, the total, against the cluster's device

``train.py`` makes the same plan at start-up, for the job's real world size, and refuses to start when the total
exceeds the device's memory (``cluster.device_memory_gib``), or a node's host memory (``cluster.host_memory_gib``)
is exceeded, or only warns (``train.memory_check=refuse|warn|off``). Terms, per GPU, in bytes:

model states
    DeepSpeed's own estimator, ``estimate_zero3_model_states_mem_needs`` (``deepspeed/runtime/zero/stage3.py``), fed
    with the exact parameter count of the model built on the meta device (our count: DeepSpeed's ``model_to_params``
    de-duplicates by ``data_ptr()``, which is 0 for every meta tensor, and so counts one tensor). Without offload it
    is ``18 P / gpus + 4 x largest layer``: bf16 weights and gradients, fp32 master weights and Adam's two moments,
    and the gathered largest fetch: the largest module, or with ``train.param_fetch=layer`` (the default) the
    largest decoder layer when that is bigger (Llama-2-7B: a layer's 202M against the embedding's 131M). With
    ``zero.offload_optimizer`` / ``offload_param`` it is what stays on the GPU, and the host memory per node is
    shown beside it.
hpZ secondary shard
    ``param bytes x P / hpz``: ZeRO++ keeps a second copy of the weights sharded over the hpZ group only, so it does
    not shrink with more nodes (Llama-2-70B: 17.2 GB per GPU at hpZ 8, on any number of nodes).
activations
    What autograd keeps for backward per token, times micro-batch x sequence length (below); with activation
    checkpointing, the input of every layer plus one recomputed layer's working set.
logits and loss
    ``(8 h + 12 V)`` bytes per token in bf16 (``12 h + 12 V`` in fp32): the final norm and ``lm_head`` input, and the
    peak of Hugging Face's causal-LM loss (bf16 logits, their fp32 copy, the log-softmax, its gradient), measured
    with ``ru_maxrss`` at 9.4-9.9 bytes per token and vocabulary entry in forward and 11.4-11.9 in backward.
buffers
    From the ``zero`` section (DeepSpeed's defaults where a key is absent): the gradient reduce bucket
    (``reduce_bucket_size`` elements), the prefetch bucket (``stage3_prefetch_bucket_size``), the gathered parameters
    DeepSpeed may keep live (``stage3_max_live_parameters``, at most the model) and the persistent small parameters
    (``stage3_param_persistence_threshold``). These are upper bounds; part of the live parameters overlaps the
    estimator's largest-layer term.
reserve
    CUDA context, NCCL and cuBLAS workspaces, allocator fragmentation: 2 GiB, a guess until a GPU calibrates it
    (``benchmarks/gpu_check.py`` prints its peak next to this plan's). Not counted for a CPU cluster.

**The activation formula** (:func:`layer_bytes_per_token`), bytes per token and decoder layer, h hidden size,
f MLP width, a query heads, hd = h / a, kvd = key/value heads x hd, s sequence length::

    Llama sdpa        bf16  20h + 4kvd + 8f + 4a + 8         fp32  32h + 8kvd + 16f + 4a + 8
      ... with a mask       + 2s, and kvd -> h when 1 < kv heads < a   + 4s (same kvd rule)
    Llama eager       bf16  24h + 8f + 6as + 8               fp32  40h + 16f + 4as + 8
    Falcon new arch   bf16  12h + 2kvd' + 4f + 4a + 2s + 8   fp32  24h + 4kvd' + 8f + 4a + 4s + 16   (sdpa)
      (40B/180B)      bf16  14h + 4f + 2as + 8               fp32  28h + 8f + 4as + 16               (eager)
                            kvd' = h unless there is a single key/value head (then kvd)
    Falcon-7B sdpa    bf16  12h + 4f + 4a + 2s + 4           fp32  24h + 8f + 4a + 4s + 8
      (multi-query, K/V expanded by zerotrain.attention; stock transformers: the math kernel, bf16 18h + 4f + 4as + 4)
    Falcon-7B eager   bf16  12h + 4f + 2as + 4               fp32  24h + 8f + 4as + 8
    checkpointing     bf16  2h per layer (its input)         fp32  4h, plus one layer's row above

Where the constants come from: measured on the models themselves, not taken from a paper. A bf16/fp32 model in train
mode on the CPU, one forward under ``torch.autograd.graph.saved_tensors_hooks``, every saved tensor counted once per
storage, parameters excluded, attributed to its decoder layer by forward pre-hooks; Llama and Falcon (both
architectures) at shapes chosen so that h, kvd, f, a and s are not proportional; ``tests/test_memory_plan.py``
re-measures every row at two sequence lengths (h 64 and 96, 1, 2 and 4 key/value heads, f 160-256, s 48 and 80,
micro-batch 2): Llama fits to the byte, Falcon within one 16-byte scalar per layer. Where the terms come from: 8f is
SwiGLU's gate, SiLU output, up and their product (bf16); 8h is ``LlamaRMSNorm``'s fp32 copy of its input, twice; 4as
is the math kernel's fp32 attention probabilities [b, a, s, s] (PyTorch upcasts bf16 there); 6as is eager's bf16
scores and fp32 softmax; 2s is the [b, 1, s, s] mask that transformers hands to SDPA, converted and saved per layer;
4a is the fused kernels' fp32 log-sum-exp. In stock transformers Falcon-7B's 71 query heads and one key/value head
make every fused SDPA kernel refuse (SDPA is called without ``enable_gqa``), hence the math kernel and its 4as term:
46 GB at 2048 tokens over 32 layers; ``zerotrain.attention.expand_multi_query_kv`` (applied by ``build_model`` under
sdpa) expands K/V to every head, which removes it (Korthikanti et al. (2022)'s GPT formula, ``34h + 5as``, has the
math-kernel row's form). Llama-2's fused-kernel row has no ``as`` term but a larger constant (45.5h at 7B, because
8f = 21.5h).

Which row applies: ``model.attn_implementation`` (``sdpa`` when absent), and always the mask rows: packed batches
carry per-document ``position_ids``, from which transformers builds a block mask whenever a sequence holds two
documents (nearly every window), unpacked ones a padding mask, and Falcon's ``sdpa`` always passes one
(``allow_is_causal_skip=False`` in ``FalconModel``); a window of one document is planned a little high.
``flash_attention_2`` is not measured (no CPU kernel): it saves what the fused sdpa kernels save, without a mask,
and is planned as the no-mask ``sdpa`` row.

**Host memory per node** (the node of rank 0, the fullest), the larger of two rows:

pretrained load (``model.pretrained_path``)
    ``C + g x b x (ceil(P / N) + 2 L)``: C the checkpoint's weight files (their sizes when the path is a local
    directory, else 2 bytes x P as the Hub ships Llama and Falcon), g ranks per node, N ranks in all, b the
    parameter width of ``train.precision``, L the largest module. What transformers' ``from_pretrained`` does under
    ZeRO-3 (``_load_pretrained_model``, ``integrations/deepspeed.py``): every rank builds the model inside
    ``zero.Init`` (each module created whole, then partitioned: ceil(P / N) kept); rank 0 *alone* opens every shard
    of the checkpoint (``safe_open``, memory-mapped, all shards mapped until the load ends; the other ranks read only
    the headers, onto the meta device), and module by module every rank gathers the module's parameters, rank 0
    copies the file's values in, and they are partitioned again. So the node of rank 0 holds the whole checkpoint
    once, never once per rank, and the shard size does not matter. 2 L: measured, two copies of the largest module in
    flight per rank at the peak (``benchmarks/pretrained_load_memory.py``, 4 CPU ranks: per rank and node, RSS and
    PSS; docs/paper.md). The checkpoint's pages are clean file pages (reclaimable page cache): a node short of them
    thrashes and re-reads rather than failing at once, but planning them resident is what keeps the load fast. Not
    counted: Python, torch and the libraries (0.4 GiB per CPU rank; a CUDA process holds more), and freed memory
    glibc keeps: tensors under its mmap threshold (dynamic, at most 32 MiB) return to the heap, not the system, so a
    model whose matrices are small (the CPU models) peaks higher with glibc's defaults (measured +57% and +74% over
    the row at 0.44 B parameters, matrices of 5-12 MiB) than with ``MALLOC_MMAP_THRESHOLD_=131072``, which the
    measurement uses; from Llama-2-7B up the matrices are 32 MiB or more and mmapped anyway.
training states
    DeepSpeed's estimate of the host memory per node (offloaded optimizer states and parameters, or the
    ``zero.Init`` staging buffer): ``host_bytes_per_node``.

What only a GPU can confirm: CUDA's flash and memory-efficient kernels save the same q, k, v, output and log-sum-exp
(the memory-efficient kernel pads the log-sum-exp to multiples of 32: about 1%), the buffer and reserve terms, and the
total against ``torch.cuda.max_memory_allocated`` (``benchmarks/gpu_check.py``'s training step).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from zerotrain import models
from zerotrain.errors import ConfigError
from zerotrain.launch.world import World, launched_world

log = logging.getLogger("zerotrain")

GIB = 2**30
RESERVE_BYTES = 2 * GIB  # CUDA context + NCCL/cuBLAS workspaces + fragmentation: a guess, see the module docstring


# --------------------------------------------------------------------------------------------------------------
# Activations: the measured per-layer formula
# --------------------------------------------------------------------------------------------------------------


def _ffn(model: models.ModelConfig) -> int:
    if model.intermediate_size:
        return model.intermediate_size
    return models.hf_config(model).intermediate_size if model.family == models.ModelFamily.llama \
        else 4 * model.hidden_size


def layer_bytes_per_token(model: models.ModelConfig, seq_len: int, attn_impl: str = "sdpa", *, masked: bool = False,
                          precision: str = "bf16") -> int:
    """Bytes autograd saves per token in one decoder layer in training (the table in the module docstring)."""
    h, a, s, f = model.hidden_size, model.num_heads, seq_len, _ffn(model)
    kv = model.num_kv_heads or a
    hd = h // a
    kvd = kv * hd
    wide = precision == "fp32"  # 4-byte activations: the measured fp32 rows
    eager = attn_impl == "eager"
    masked = masked and attn_impl != "flash_attention_2"  # flash attention takes no mask (varlen for documents)
    if model.family == models.ModelFamily.llama:
        if eager:
            return 40 * h + 16 * f + 4 * a * s + 8 if wide else 24 * h + 8 * f + 6 * a * s + 8
        # With a mask transformers repeats the key/value heads (a copy, unless one head: a broadcast view).
        kv_saved = h if masked and 1 < kv < a else kvd
        mask = (4 if wide else 2) * s if masked else 0
        row = 32 * h + 8 * kv_saved + 16 * f + 4 * a + 8 if wide else 20 * h + 4 * kv_saved + 8 * f + 4 * a + 8
        return row + mask
    if model.new_decoder_architecture:
        if eager:
            return 28 * h + 8 * f + 4 * a * s + 16 if wide else 14 * h + 4 * f + 2 * a * s + 8
        kv_saved = kvd if kv == 1 else h
        mask = 0 if attn_impl == "flash_attention_2" else (4 if wide else 2) * s
        row = 24 * h + 4 * kv_saved + 8 * f + 4 * a + 16 if wide else 12 * h + 2 * kv_saved + 4 * f + 4 * a + 8
        return row + mask
    # Falcon-7B's layout (multi-query, parallel attention). Under sdpa zerotrain.attention expands K/V to every
    # head, so a fused kernel runs (with Falcon's mask); stock transformers would fall back to the math kernel.
    if eager:
        return 24 * h + 8 * f + 4 * a * s + 8 if wide else 12 * h + 4 * f + 2 * a * s + 4
    mask = 0 if attn_impl == "flash_attention_2" else (4 if wide else 2) * s
    return (24 * h + 8 * f + 4 * a + 8 if wide else 12 * h + 4 * f + 4 * a + 4) + mask


def activation_bytes_per_token(model: models.ModelConfig, seq_len: int, checkpointing: bool, attn_impl: str = "sdpa",
                               *, masked: bool = False, precision: str = "bf16") -> int:
    """Saved activations of all decoder layers per token of a micro-batch (the head is :func:`head_bytes_per_token`).

    With checkpointing every layer keeps only its input (2h bytes in bf16), and backward recomputes one layer at a
    time, so one layer's full row is added once.
    """
    row = layer_bytes_per_token(model, seq_len, attn_impl, masked=masked, precision=precision)
    if checkpointing:
        return model.num_layers * (4 if precision == "fp32" else 2) * model.hidden_size + row
    return model.num_layers * row


def head_bytes_per_token(model: models.ModelConfig, precision: str = "bf16") -> int:
    """Final norm, ``lm_head`` input and the loss's peak (logits, fp32 copy, log-softmax, gradient) per token."""
    return (12 if precision == "fp32" else 8) * model.hidden_size + 12 * model.vocab_size


# --------------------------------------------------------------------------------------------------------------
# Parameters, counted on the meta device
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParameterCounts:
    total: int
    """Every parameter once (tied embeddings once)."""
    largest_module: int
    """The largest module's own parameters (the embedding, for every shipped model): DeepSpeed's largest layer."""
    persistent: int
    """Parameters of at most ``persistence_threshold`` elements each, which ZeRO-3 keeps gathered."""
    largest_fetch: int = 0
    """The most parameters one ZeRO-3 fetch gathers: the largest module, or under ``train.param_fetch=layer`` the
    largest decoder layer if that is bigger (0: not counted, taken as ``largest_module``)."""


def count_parameters(model: models.ModelConfig, persistence_threshold: int = 0,
                     fetch: models.ParamFetch = models.ParamFetch.module) -> ParameterCounts:
    """Exact counts on the meta device: no memory, no weights, a fraction of a second even for 180B."""
    with torch.device("meta"):  # the class, not _from_config, which could enter zero.Init in a training process
        module = models.MODEL_CLASSES[model.family](models.hf_config(model))
    unique = {id(p): p for p in module.parameters()}.values()
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in module.modules())
    fetched = largest
    if fetch == models.ParamFetch.layer:
        layers = tuple(models.fetch_layer_classes(module))
        fetched = max(largest, *(sum(p.numel() for p in m.parameters()) for m in module.modules()
                                 if isinstance(m, layers)))
    return ParameterCounts(total=sum(p.numel() for p in unique), largest_module=largest,
                           persistent=sum(p.numel() for p in unique if p.numel() <= persistence_threshold),
                           largest_fetch=fetched)


# --------------------------------------------------------------------------------------------------------------
# The world the plan is for
# --------------------------------------------------------------------------------------------------------------


def planned_world(cluster: Any) -> World:
    """The recipe's intended shape: ``cluster.nodes`` x ``cluster.gpus_per_node``."""
    return World(cluster.nodes, cluster.gpus_per_node, "cluster.nodes x cluster.gpus_per_node")


# --------------------------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Term:
    name: str
    bytes: int
    note: str = ""


@dataclass(frozen=True)
class MemoryPlan:
    recipe: str | None
    world: World
    hpz_size: int
    precision: str
    micro_batch_size: int
    seq_len: int
    checkpointing: bool
    attention: str
    """The attention path the activation row is for."""
    params: ParameterCounts
    terms: tuple[Term, ...]
    activations_other: int
    """The activations with the other checkpointing choice, to show what switching would give."""
    host_bytes_per_node: int
    """DeepSpeed's estimate of host memory per node (offloaded states, or the zero.Init staging buffer)."""
    device_bytes: int | None
    """The device's memory; None: unknown, no check."""
    device_source: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    load: Term | None = None
    """Host bytes on rank 0's node while ``model.pretrained_path`` loads (:func:`pretrained_load_bytes`); None: the
    model is built from scratch."""
    host_memory_bytes: int | None = None
    """One node's host memory; None: unknown, no check."""
    host_source: str = ""

    @property
    def total(self) -> int:
        return sum(t.bytes for t in self.terms)

    def term(self, name: str) -> int:
        return next(t.bytes for t in self.terms if t.name == name)

    @property
    def total_other(self) -> int:
        """The total with the other checkpointing choice."""
        return self.total - self.term("activations") + self.activations_other

    @property
    def fits(self) -> bool | None:
        return None if self.device_bytes is None else self.total <= self.device_bytes

    @property
    def host_peak(self) -> int:
        """Host bytes per node: the pretrained load or the training states, whichever is larger."""
        return max(self.load.bytes if self.load else 0, self.host_bytes_per_node)

    @property
    def host_fits(self) -> bool | None:
        return None if self.host_memory_bytes is None else self.host_peak <= self.host_memory_bytes


def _zero_settings(zero: Mapping[str, Any]):
    """DeepSpeed's own reading of the zero section: its defaults for absent keys, aliases resolved."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    checked = {k: v for k, v in zero.items() if k != "zero_hpz_partition_size"}
    return DeepSpeedZeroConfig(**checked)


def _offload_device(section: Any) -> str | None:
    if section is None:
        return None
    device = getattr(section.device, "value", section.device)
    return None if device in (None, "none") else str(device)


def hpz_size(zero: Mapping[str, Any], world: World) -> int:
    """``zero_hpz_partition_size`` for this world: ``auto`` is devices per node, at most the world size."""
    value = zero.get("zero_hpz_partition_size", 1)
    size = world.gpus_per_node if value == "auto" else int(value or 1)
    return max(1, min(size, world.gpus))


def _run_choices(cfg: Any) -> tuple[bool, str, bool]:
    """Activation checkpointing, attention implementation and whether batches carry an attention mask: always, as
    packed batches carry per-document position_ids, from which transformers builds a block mask whenever a sequence
    holds more than one document (nearly every window), and unpacked ones carry a padding mask."""
    return bool(cfg.train.activation_checkpointing), str(cfg.model.attn_implementation), True


def _attention_path(model: models.ModelConfig, attn_impl: str, masked: bool) -> str:
    if model.family == models.ModelFamily.falcon and not model.new_decoder_architecture and attn_impl == "sdpa":
        return "sdpa with mask (multi-query K/V expanded: a fused kernel)"
    if model.family == models.ModelFamily.falcon and attn_impl == "sdpa":
        return "sdpa with mask (Falcon always passes one)"
    return f"{attn_impl}{' with mask' if masked and attn_impl != 'flash_attention_2' else ''}"


def device_memory(cluster: Any, local_rank: int = 0) -> tuple[int | None, str]:
    """The device's bytes: ``cluster.device_memory_gib``, else a visible CUDA device's own total, else unknown."""
    if cluster.device_memory_gib > 0:
        return int(cluster.device_memory_gib * GIB), "cluster.device_memory_gib"
    if str(cluster.accelerator) != "cpu" and torch.cuda.is_available():
        index = min(local_rank, torch.cuda.device_count() - 1)
        return torch.cuda.get_device_properties(index).total_memory, f"cuda:{index}'s total memory"
    return None, "unknown (cluster.device_memory_gib=0)"


def _meminfo_total(meminfo: Path = Path("/proc/meminfo")) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"{meminfo} has no MemTotal line")


def _cgroup_limit(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """This process's cgroup v2 memory limit (``memory.max``: SLURM's --mem), None when unlimited or unreadable."""
    try:
        relative = Path("/proc/self/cgroup").read_text().strip().rpartition(":")[2].lstrip("/")
        limit = (cgroup_root / relative / "memory.max").read_text().strip()
    except OSError:
        return None
    return None if limit == "max" else int(limit)


def host_memory(cluster: Any, at_start: bool = False) -> tuple[int | None, str]:
    """One node's host bytes: ``cluster.host_memory_gib``, else at start-up (on the node itself) its MemTotal or
    the job's cgroup limit, whichever is lower, else unknown (``--plan`` on a login node knows nothing of the
    compute nodes)."""
    if cluster.host_memory_gib > 0:
        return int(cluster.host_memory_gib * GIB), "cluster.host_memory_gib"
    if not at_start:
        return None, "unknown (cluster.host_memory_gib=0)"
    total, limit = _meminfo_total(), _cgroup_limit()
    if limit is not None and limit < total:
        return limit, "this job's cgroup memory.max (cluster.host_memory_gib=0)"
    return total, "this node's MemTotal (cluster.host_memory_gib=0)"


def checkpoint_bytes(spec: str, params: int) -> tuple[int, str]:
    """The bytes of a checkpoint's weight files (what transformers reads: the safetensors, else the .bin files) when
    ``spec`` is a local directory; else (a Hub id, a path on another machine) 2 bytes per parameter."""
    directory = Path(spec)
    files = (sorted(directory.glob("*.safetensors")) or sorted(directory.glob("*.bin"))) if directory.is_dir() else []
    if files:
        return sum(f.stat().st_size for f in files), f"{len(files)} weight file(s) in {directory}"
    return 2 * params, "2 bytes x P, not a local directory: the Hub's Llama and Falcon weights are bf16/fp16"


def pretrained_load_bytes(checkpoint: int, params: ParameterCounts, width: int, world: World) -> int:
    """Host bytes on rank 0's node while transformers loads a checkpoint under ZeRO-3: the whole checkpoint mapped
    by rank 0 alone, and on every rank its partition plus two copies of the largest module (the module docstring)."""
    return checkpoint + world.gpus_per_node * width * (-(-params.total // world.gpus) + 2 * params.largest_module)


def plan(cfg: Any, world: World | None = None, device: tuple[int | None, str] | None = None,
         checkpointing: bool | None = None, host: tuple[int | None, str] | None = None) -> MemoryPlan:
    """The per-GPU memory plan of a run config (``zerotrain.run_config.Config``) on ``world`` (default: the
    recipe's planned world), against ``device`` (default: :func:`device_memory`) and ``host`` (default:
    :func:`host_memory`). ``checkpointing`` overrides the config's activation checkpointing (for callers that build
    the model themselves, e.g. the GPU check)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    world = world or planned_world(cfg.cluster)
    device = device or device_memory(cfg.cluster)
    host = host or host_memory(cfg.cluster)
    model, train = cfg.model, cfg.train
    precision = str(train.precision)
    width = 4 if precision == "fp32" else 2
    zero = _zero_settings(cfg.zero)
    counts = count_parameters(model, zero.param_persistence_threshold,
                              getattr(train, "param_fetch", models.ParamFetch.layer))  # read as the other keys
    offload_optimizer = _offload_device(zero.offload_optimizer) is not None
    offload_param = _offload_device(zero.offload_param) is not None
    host_states, states, _ = estimate_zero3_model_states_mem_needs(
        counts.total, counts.largest_fetch or counts.largest_module, num_gpus_per_node=world.gpus_per_node,
        num_nodes=world.nodes,
        cpu_offload=offload_optimizer, cpu_offload_params=offload_optimizer and offload_param, zero_init=True)
    notes = []
    if precision == "fp32":  # the estimator assumes 2-byte weights and gradients; fp32 keeps 4-byte ones
        states += 4 * counts.total // world.gpus
        notes.append("fp32: +4 bytes per parameter over the estimator's bf16 weights and gradients")
    if offload_param and not offload_optimizer:
        notes.append("zero.offload_param without offload_optimizer: planned as no offload (DeepSpeed's estimator "
                     "has no such case)")
    hpz = hpz_size(cfg.zero, world)
    secondary = width * counts.total // hpz if hpz > 1 else 0

    configured, attn_impl, masked = _run_choices(cfg)
    checkpointing = configured if checkpointing is None else checkpointing
    tokens = train.micro_batch_size * train.seq_len

    def activations(ckpt: bool) -> int:
        return tokens * activation_bytes_per_token(model, train.seq_len, ckpt, attn_impl, masked=masked,
                                                   precision=precision)

    buffers = [
        # A bucket never holds more than the model: DeepSpeed sizes it min(bucket, what there is to reduce/fetch).
        ("reduce bucket", width * min(zero.reduce_bucket_size, counts.total)),
        ("prefetch bucket", width * min(zero.prefetch_bucket_size, counts.total)),
        ("live parameters", width * min(zero.max_live_parameters, counts.total)),
        ("persistent parameters", width * counts.persistent),
    ]
    gpu = str(cfg.cluster.accelerator) != "cpu"
    terms = (
        Term("model states", int(states),
             "ZeRO-3, DeepSpeed's estimator" + (", optimizer offloaded" if offload_optimizer else "")
             + (", parameters offloaded" if offload_optimizer and offload_param else "")),
        Term("hpZ secondary shard", secondary, f"{width} bytes x P / {hpz}" if hpz > 1 else "hpZ off"),
        Term("activations", activations(checkpointing),
             f"{'with' if checkpointing else 'no'} checkpointing; {_attention_path(model, attn_impl, masked)}"),
        Term("logits and loss", tokens * head_bytes_per_token(model, precision), f"vocabulary {model.vocab_size:,}"),
        Term("buffers", sum(b for _, b in buffers), ", ".join(f"{n} {_gib(b)}" for n, b in buffers)),
        Term("reserve", RESERVE_BYTES if gpu else 0,
             "CUDA context, NCCL, cuBLAS, fragmentation (a guess)" if gpu else "CPU cluster: none"),
    )
    load = None
    if model.pretrained_path:
        on_disk, source = checkpoint_bytes(model.pretrained_path, counts.total)
        load = Term("pretrained load", pretrained_load_bytes(on_disk, counts, width, world),
                    f"{world.gpus_per_node} ranks x {width} bytes x (P / {world.gpus} + 2 x largest module) + the "
                    f"{_gib(on_disk)} checkpoint ({source})")
    return MemoryPlan(
        recipe=cfg.run.recipe, world=world, hpz_size=hpz, precision=precision,
        micro_batch_size=train.micro_batch_size, seq_len=train.seq_len, checkpointing=checkpointing,
        attention=_attention_path(model, attn_impl, masked), params=counts, terms=terms,
        activations_other=activations(not checkpointing), host_bytes_per_node=int(host_states),
        device_bytes=device[0], device_source=device[1], notes=tuple(notes), load=load,
        host_memory_bytes=host[0], host_source=host[1])


# --------------------------------------------------------------------------------------------------------------
# Printing and the start-up check
# --------------------------------------------------------------------------------------------------------------


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB // 10 or n == 0 else f"{n / 2**20:.2f} MiB"


def _verdict(what: str, capacity: int | None, source: str, need: int) -> str:
    if capacity is None:
        return f"{what} {source}: not checked"
    room = capacity - need
    state = f"fits, {_gib(room)} to spare" if room >= 0 else f"DOES NOT FIT, {_gib(-room)} over"
    return f"of {_gib(capacity)} ({source}): {state}"


def verdict(p: MemoryPlan) -> str:
    return _verdict("device memory", p.device_bytes, p.device_source, p.total)


def host_verdict(p: MemoryPlan) -> str:
    return _verdict("host memory", p.host_memory_bytes, p.host_source, p.host_peak)


def describe(p: MemoryPlan) -> str:
    """The plan as the ``--plan`` printout."""
    fetch = p.params.largest_fetch
    fetched = f", largest layer fetched {fetch:,}" if fetch > p.params.largest_module else ""
    head = (f"memory plan per GPU: recipe {p.recipe or '-'}, {p.params.total:,} parameters (largest module "
            f"{p.params.largest_module:,}{fetched}), {p.world.nodes} node(s) x {p.world.gpus_per_node} GPU(s) "
            f"({p.world.source}), hpZ {p.hpz_size}, {p.precision}, micro-batch {p.micro_batch_size} x "
            f"{p.seq_len} tokens")
    width = max(len(t.name) for t in p.terms)
    lines = [head] + [f"  {t.name:<{width}}  {_gib(t.bytes):>12}  {t.note}" for t in p.terms]
    lines.append(f"  {'total':<{width}}  {_gib(p.total):>12}  {verdict(p)}")
    other = "with" if not p.checkpointing else "without"
    lines.append(f"  {other} activation checkpointing: activations {_gib(p.activations_other)}, total "
                 f"{_gib(p.total_other)}")
    lines.append("host memory per node (rank 0's node):")
    host = ([p.load] if p.load else []) + [Term("training states", p.host_bytes_per_node, "DeepSpeed's estimate")]
    lines += [f"  {t.name:<{width}}  {_gib(t.bytes):>12}  {t.note}" for t in host]
    lines.append(f"  {'host peak':<{width}}  {_gib(p.host_peak):>12}  {host_verdict(p)}")
    lines += [f"  note: {n}" for n in p.notes]
    return "\n".join(lines)


def _remedies(p: MemoryPlan, can_checkpoint: bool) -> str:
    options = []
    if can_checkpoint and not p.checkpointing:
        verb = "plan" if p.total_other <= (p.device_bytes or 0) else "still"
        options.append(f"train.activation_checkpointing=true ({verb}: {_gib(p.total_other)})")
    options += ["a shorter train.seq_len or train.micro_batch_size", "more nodes (model states shrink; the hpZ "
                "shard does not)", "zero=zero3_offload_optimizer (optimizer states in host memory)"]
    return "; ".join(options)


def _host_remedies(p: MemoryPlan) -> str:
    """What would bring the host peak under the node's memory, with the numbers."""
    assert p.host_memory_bytes is not None
    options = []
    if p.load and p.load.bytes >= p.host_bytes_per_node:
        width = 4 if p.precision == "fp32" else 2
        on_disk = p.load.bytes - pretrained_load_bytes(0, p.params, width, p.world)
        for nodes in (2 * p.world.nodes, 4 * p.world.nodes, 8 * p.world.nodes):
            more = World(nodes, p.world.gpus_per_node, "")
            if pretrained_load_bytes(on_disk, p.params, width, more) <= p.host_memory_bytes:
                options.append(f"more nodes ({nodes}: pretrained load "
                               f"{_gib(pretrained_load_bytes(on_disk, p.params, width, more))})")
                break
        if on_disk > 2 * p.params.total:
            options.append(f"the checkpoint saved in bf16 (2 bytes x P = {_gib(2 * p.params.total)} instead of "
                           f"{_gib(on_disk)})")
        # The partitions of a node add up to b x P / nodes whatever g is: fewer ranks per node save only 2 L each.
        options.append(f"fewer ranks per node ({_gib(2 * width * p.params.largest_module)} each: the largest "
                       f"module in flight). A smaller shard size does not help: rank 0 alone maps the whole "
                       f"{_gib(on_disk)} checkpoint, all its shards at once")
    else:
        options.append("less offload (zero.offload_param, then zero.offload_optimizer) or more nodes")
    options.append("cluster.host_memory_gib=<the node's real memory> if it is not what was read")
    return "; ".join(options)


def check_at_start(cfg: Any, environ: Mapping[str, str] = os.environ) -> MemoryPlan | None:
    """The start-up check of ``train.py``, before any process group: the plan for the launched world against the
    device and against the node's host memory. ``refuse`` raises :class:`ConfigError` when either does not fit,
    ``warn`` logs (rank 0), ``off`` skips."""
    policy = str(cfg.train.memory_check)
    if policy == "off":
        return None
    local_rank = int(environ.get("LOCAL_RANK") or environ.get("SLURM_LOCALID") or 0)
    p = plan(cfg, launched_world(environ), device_memory(cfg.cluster, local_rank),
             host=host_memory(cfg.cluster, at_start=True))
    rank0 = (environ.get("RANK") or environ.get("SLURM_PROCID") or "0") == "0"
    if rank0:
        log.info("memory plan: %s per GPU %s; host %s per node %s", _gib(p.total), verdict(p), _gib(p.host_peak),
                 host_verdict(p))
    problems = []
    if p.fits is False:
        assert p.device_bytes is not None  # a verdict needs the device's size
        remedies = _remedies(p, can_checkpoint=hasattr(cfg.train, "activation_checkpointing"))
        problems.append(f"memory plan: {_gib(p.total)} per GPU exceeds the device's {_gib(p.device_bytes)} "
                        f"({p.device_source}) by {_gib(p.total - p.device_bytes)}. To fit: {remedies}.")
    if p.host_fits is False:
        assert p.host_memory_bytes is not None
        what = "pretrained load" if p.load and p.load.bytes >= p.host_bytes_per_node else "training states"
        problems.append(f"memory plan: {_gib(p.host_peak)} of host memory per node ({what}) exceeds the node's "
                        f"{_gib(p.host_memory_bytes)} ({p.host_source}) by {_gib(p.host_peak - p.host_memory_bytes)}"
                        f". To fit: {_host_remedies(p)}.")
    if not problems:
        return p
    message = "\n".join(problems) + f"\n{describe(p)}"
    if policy == "refuse":
        raise ConfigError(message + "\nTo start anyway: train.memory_check=warn (or off).")
    if rank0:
        log.warning("%s\nStarting anyway (train.memory_check=warn).", message)
    return p


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 10**8 else f"{n / 1e6:.2f} M"


def markdown_table(plans: list[MemoryPlan]) -> str:
    """One row per plan, GiB per GPU, for docs/paper.md (``python train.py --plan --all``)."""
    def g(n: int) -> str:
        return f"{n / GIB:.1f}" if n >= GIB // 10 or n == 0 else f"{n / GIB:.2g}"

    lines = ["| recipe | nodes × GPUs | micro batch × seq | parameters | model states | hpZ shard | activations "
             "| logits + loss | buffers + reserve | **total** | activation ckpt | total with the other ckpt choice "
             "| device |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in plans:
        device = "?" if p.device_bytes is None else f"{g(p.device_bytes)}: {'fits' if p.fits else '**does not fit**'}"
        lines.append(
            f"| `{p.recipe}` | {p.world.nodes} × {p.world.gpus_per_node} | {p.micro_batch_size} × {p.seq_len} "
            f"| {_count(p.params.total)} | {g(p.term('model states'))} | {g(p.term('hpZ secondary shard'))} "
            f"| {g(p.term('activations'))} | {g(p.term('logits and loss'))} "
            f"| {g(p.term('buffers') + p.term('reserve'))} | **{g(p.total)}** | {'on' if p.checkpointing else 'off'} "
            f"| {g(p.total_other)} | {device} |")
    return "\n".join(lines)

