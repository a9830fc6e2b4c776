"""``BenchConfig``: what ``kvroll bench`` sweeps (policies x budgets x batch sizes x output lengths) on one model.

    config = load_config("configs/bench/cpu_smollm2.yaml", ["--batch_sizes", "2,4"])
    config.points()   # the measurements, in the order the sweep runs them

Flat YAML keys are the field names; every field is also a ``--field value`` override on the command line (the
value is read as YAML; a list field also takes ``a,b,c``). Every check runs in ``__post_init__``, before any
model is loaded, and raises a ``ValueError`` naming the field, the value and the fix.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from kvroll.bench.models import ARCHITECTURES
from kvroll.checks import as_int, plain
from kvroll.model_dir import model_dir_problem

SEED_LIMIT = 1 << 63  # the bench seeds its weights, prompt and sampling from one non-negative int

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class BenchConfig:
    """One benchmark sweep; see the module docstring and ``configs/bench/*.yaml``."""

    model: str | None = field(default=None, metadata={
        "help": "'smollm2' (embedded) or a local HF model directory; leave empty when 'architecture' is set."})
    architecture: str | None = field(default=None, metadata={
        "help": f"an architecture with random weights, one of {sorted(ARCHITECTURES)} (EOS is ignored anyway)."})
    policies: list = field(default_factory=lambda: ["full", "longflow"], metadata={
        "help": "eviction policies to measure; 'full' is the reference the ratios divide by."})
    budgets: Any = field(default_factory=lambda: [256], metadata={
        "help": "tokens kept per sequence and KV head: a list for every compressing policy, or a mapping "
                "{policy: [budgets]}; 'full' takes none."})
    policy_kwargs: dict = field(default_factory=dict, metadata={
        "help": "{policy: {hyperparameter: value}}, e.g. {rkv: {buffer: 8}}."})
    batch_sizes: list = field(default_factory=lambda: ["max"], metadata={
        "help": "sequences decoded together: integers, or 'max' (the largest batch whose KV cache fits in free "
                "memory minus reserve_gb)."})
    output_lengths: list = field(default_factory=lambda: [16384], metadata={
        "help": "new tokens per sequence that the reported rate is for (EOS ignored)."})
    prompt_length: int = field(default=512, metadata={"help": "tokens of the (random) prompt of every sequence."})
    steady_steps: int = field(default=1024, metadata={
        "help": "decode steps a compressing policy runs after its cache first fills; the rest of the output "
                "length is extrapolated at the measured steady step (said so in the report)."})
    full_steps: int = field(default=48, metadata={
        "help": "decode steps timed at each context length of 'full' (its cache is filled to each length)."})
    hf_generate: bool = field(default=True, metadata={
        "help": "also measure HF generate with a static cache (TRL's default rollout path) in the same run."})
    hf_new_tokens: list = field(default_factory=lambda: [16, 80], metadata={
        "help": "two lengths of HF generate runs; the decode rate is their difference (prefill cancels)."})
    reserve_gb: float = field(default=8.0, metadata={
        "help": "memory left free for activations and temporaries when finding the largest batch, in GiB (2**30 "
                "bytes)."})
    max_batch_cap: int = field(default=1024, metadata={"help": "the largest batch 'max' may pick."})
    temperature: float = field(default=1.0, metadata={"help": "sampling temperature of every run."})
    seed: int = field(default=0, metadata={"help": "seed of the prompt, the weights and the sampling."})
    dtype: str = field(default="auto", metadata={"help": f"one of {DTYPES}; auto: bfloat16 on CUDA, else float32."})
    device: str = field(default="auto", metadata={"help": f"one of {DEVICES}; auto: cuda when available."})
    threads: int | None = field(default=None, metadata={"help": "torch CPU threads (default: torch's)."})
    fused_mlp: bool | None = field(default=None, metadata={
        "help": "engines fuse each MLP's gate+up matmul and SiLU*mul (RolloutEngine fused_mlp; CUDA only). It is "
                "installed on the shared model, so HF generate measured after an engine in the same run takes it "
                "too (as it takes the fused RMSNorm): compare HF rates from a run with it off. Default (null): on "
                "for CUDA, as the engine's."})
    fused_qkv_rotary: bool | None = field(default=None, metadata={
        "help": "engines run each attention's decode prologue as one QKV matmul, (Qwen3) the q/k norms and one "
                "rotary kernel (RolloutEngine fused_qkv_rotary; CUDA decode steps only; HF generate keeps HF's). "
                "Default (null): on for CUDA."})
    fused_add_norm: bool | None = field(default=None, metadata={
        "help": "engines run each decoder layer's mid-layer residual add and post-attention RMSNorm as one kernel "
                "(RolloutEngine fused_add_norm; CUDA decode steps only; HF generate keeps HF's). Default (null): on "
                "for CUDA."})
    fused_sampling: bool | None = field(default=None, metadata={
        "help": "engines draw each decode step's tokens, their logprobs and the finite check in two Triton kernels "
                "(RolloutEngine fused_sampling; kvroll/kernels/sample.py). Default (null): on for CUDA, as the engine's."})

    def __post_init__(self):
        self._plain_numbers()
        self._check_model()
        self.policies = _nonempty_list("policies", self.policies, "e.g. policies: [full, longflow]")
        self.batch_sizes = _nonempty_list("batch_sizes", self.batch_sizes, "e.g. batch_sizes: [max] or [2, 4]")
        for b in self.batch_sizes:
            if b != "max" and not _is_int(b, 1):
                raise ValueError(f"batch_sizes holds {b!r}: each entry must be an integer >= 1 or 'max'.")
        self.output_lengths = _nonempty_list("output_lengths", self.output_lengths, "e.g. output_lengths: [1024]")
        for n in self.output_lengths:
            if not _is_int(n, 1):
                raise ValueError(f"output_lengths holds {n!r}: each entry must be an integer >= 1.")
        for name in ("prompt_length", "steady_steps", "max_batch_cap", "full_steps"):
            if not _is_int(getattr(self, name), 2 if name == "full_steps" else 1):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: it must be an integer >= "
                                 f"{2 if name == 'full_steps' else 1}.")
        for name in ("batch_sizes", "output_lengths"):
            _no_duplicates(name, getattr(self, name))
        if "full" in self.policies and self.full_steps >= min(self.output_lengths):
            raise ValueError(f"full_steps={self.full_steps} must be below every output length (the shortest, "
                             f"{min(self.output_lengths)}): 'full' times that many steps inside the output at each "
                             "context; lower full_steps, or lengthen output_lengths.")
        self._check_hf()
        # the checks above import no torch (these do: the policy registry, the model's config), so a typo costs none
        self._check_policies()
        self._check_choices()
        self._check_positions()

    def _plain_numbers(self):
        """Numpy numbers in every field (and its lists and mappings) as Python ints and floats: the config is written
        as JSON. The checks below judge the values."""
        for f in fields(self):
            setattr(self, f.name, _plain(getattr(self, f.name)))

    # ---- checks ----------------------------------------------------------------------------------------------
    def _check_model(self):
        for name in ("model", "architecture"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: it must be a string (model: smollm2 or a "
                                 f"local directory; architecture: one of {sorted(ARCHITECTURES)}).")
        if (self.model is None) == (self.architecture is None):
            raise ValueError(f"model={self.model!r}, architecture={self.architecture!r}: set exactly one of them "
                             f"(model: smollm2, or architecture: one of {sorted(ARCHITECTURES)}).")
        if self.architecture is not None and self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture={self.architecture!r} is unknown; choose one of {sorted(ARCHITECTURES)} "
                             "or give a local model directory as 'model'.")
        if self.model is not None and self.model != "smollm2" and not (Path(self.model) / "config.json").is_file():
            raise ValueError(f"model={self.model!r} is neither 'smollm2' nor a local HF model directory with a "
                             "config.json; pass one of those, or 'architecture' for random weights.")
        problem = None if self.model in (None, "smollm2") else model_dir_problem(self.model, tokenizer=True, gguf=False)
        if problem:
            raise ValueError(f"model={self.model!r} {problem}; or set 'architecture' for random weights.")

    def _check_policies(self):
        from kvroll.policies import known_policies

        known = known_policies()
        for name in self.policies:  # before the registry loads
            if not isinstance(name, str) or name not in known:
                raise ValueError(f"policies holds {name!r}, which is not a known policy; choose from "
                                 f"{sorted(known)}.")
        from kvroll.config import CompressionConfig
        from kvroll.policies.registry import POLICIES

        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"policies={self.policies!r} names a policy twice; list each once.")
        kwargs = self.policy_kwargs
        if not isinstance(kwargs, dict) or not all(isinstance(v, dict) for v in kwargs.values()):
            raise ValueError(f"policy_kwargs={self.policy_kwargs!r} must map a policy to its hyperparameters, e.g. "
                             "{rkv: {buffer: 8}}.")
        stray = sorted(set(self.policy_kwargs) - set(POLICIES))  # policies not swept this time may keep theirs
        if stray:
            raise ValueError(f"policy_kwargs names {stray}, which are not known policies; choose from "
                             f"{sorted(POLICIES)}.")
        if not isinstance(self.budgets, (list, dict)):
            self.budgets = _nonempty_list("budgets", self.budgets, "e.g. budgets: [256]")
        stray = sorted(set(self.budgets) - set(POLICIES)) if isinstance(self.budgets, dict) else []
        if stray:  # a mistyped name's budgets would be dropped without a word
            raise ValueError(f"budgets names {stray}, which are not known policies; choose from {sorted(POLICIES)}.")
        for name in self.policies:
            _no_duplicates(f"budgets of {name!r}", self.budgets_of(name))
            for budget in self.budgets_of(name):
                if budget is not None and not _is_int(budget, 1):
                    raise ValueError(f"budgets of {name!r} holds {budget!r}: each budget must be an integer >= 1.")
                try:
                    CompressionConfig(name, budget, **self.policy_kwargs.get(name, {}))
                except (TypeError, ValueError) as err:
                    raise ValueError(f"policies/budgets/policy_kwargs: {name} at budget {budget}: {err}") from None

    def _check_hf(self):
        hf = self.hf_new_tokens
        if not (isinstance(hf, list) and len(hf) == 2 and all(_is_int(n, 1) for n in hf) and hf[0] < hf[1]):
            raise ValueError(f"hf_new_tokens={hf!r} is invalid: give two increasing lengths, e.g. [16, 80] "
                             "(the rate is their difference).")
        if self.hf_generate and hf[1] > min(self.output_lengths):
            raise ValueError(f"hf_new_tokens={hf!r} runs past the shortest output length {min(self.output_lengths)}: HF "
                             "generate's StaticCache holds prompt + output tokens; keep its second length <= "
                             f"{min(self.output_lengths)}, or set hf_generate: false.")

    def _check_choices(self):
        from kvroll.rollout.sampling import MIN_TEMPERATURE, finite_number

        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is invalid: choose one of {DTYPES}.")
        if self.device not in DEVICES:
            raise ValueError(f"device={self.device!r} is invalid: choose one of {DEVICES}.")
        if not (finite_number(self.reserve_gb) and self.reserve_gb >= 0):
            raise ValueError(f"reserve_gb={self.reserve_gb!r} is invalid: it must be a number >= 0 (GiB).")
        if self.threads is not None and not _is_int(self.threads, 1):
            raise ValueError(f"threads={self.threads!r} is invalid: an integer >= 1, or leave it out.")
        if not isinstance(self.hf_generate, bool):  # a quoted "false" would be truthy: HF generate measured anyway
            raise ValueError(f"hf_generate={self.hf_generate!r} is invalid: it must be true or false (unquoted).")
        for name, value in self.switches().items():
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} is invalid: it must be true, false or null (on for CUDA).")
        t = self.temperature
        if not (finite_number(t) and (t == 0 or t >= MIN_TEMPERATURE)):
            raise ValueError(f"temperature={t!r} is invalid: it must be 0 (greedy) or a finite number >= "
                             f"{MIN_TEMPERATURE} (as SamplingParams.temperature).")
        if not (_is_int(self.seed, 0) and self.seed < SEED_LIMIT):
            raise ValueError(f"seed={self.seed!r} is invalid: it must be an integer in [0, 2**63).")

    def _check_positions(self):
        """The prompt, every budget and the lengths 'full' runs to within the model's max_position_embeddings, read
        from the architecture's spec or the model's config.json (no weights), as RolloutEngine checks them."""
        from types import SimpleNamespace

        from kvroll.config import CompressionConfig
        from kvroll.rollout.model import check_budget_fits, load_config

        config = SimpleNamespace(**ARCHITECTURES[self.architecture]) if self.architecture else load_config(self.model)
        limit, prompt = getattr(config, "max_position_embeddings", None), self.prompt_length
        if limit is None:
            return
        if prompt > limit:
            raise ValueError(f"prompt_length={prompt} exceeds the model's max_position_embeddings={limit}; use "
                             f"prompt_length <= {limit}.")
        longest = max(self.output_lengths)
        if "full" in self.policies and prompt + longest > limit:
            raise ValueError(f"output_lengths holds {longest}: prompt_length={prompt} + {longest} = {prompt + longest} "
                             f"exceeds the model's max_position_embeddings={limit}, and policy 'full' keeps every "
                             f"token at its true position; use output_lengths <= {limit - prompt}, or leave 'full' out "
                             "of policies.")
        for name in self.policies:
            for budget in self.budgets_of(name):
                try:
                    check_budget_fits(config, CompressionConfig(name, budget, **self.policy_kwargs.get(name, {})))
                except ValueError as err:
                    raise ValueError(f"budgets/policy_kwargs: {name} at budget {budget}: {err}") from None

    # ---- the sweep -------------------------------------------------------------------------------------------
    def switches(self) -> dict:
        """The engine's decode-step fusion switches (``RolloutEngine`` keywords, kvroll/kernels/fusions.py)."""
        from kvroll.kernels.fusions import SWITCHES

        return {name: getattr(self, name) for name in SWITCHES}

    def budgets_of(self, policy: str) -> list:
        """The budgets ``policy`` is measured at ([None] for ``full``)."""
        if policy == "full":
            return [None]
        budgets = self.budgets.get(policy) if isinstance(self.budgets, dict) else self.budgets
        if budgets is None:
            raise ValueError(f"budgets={self.budgets!r} gives no budget for {policy!r}; add '{policy}: [N]'.")
        return _nonempty_list(f"budgets of {policy!r}", budgets, f"e.g. budgets: {{{policy}: [1024]}}")

    def points(self) -> list[dict]:
        """Every measurement: per (batch, output length), ``full`` and HF generate first (the ratios' bases)."""
        out = []
        for batch in self.batch_sizes:
            for length in self.output_lengths:
                if "full" in self.policies:
                    out.append({"kind": "engine", "policy": "full", "budget": None, "batch": batch, "length": length})
                if self.hf_generate:
                    out.append({"kind": "hf_generate", "policy": "hf_generate", "budget": None, "batch": batch,
                                "length": length})
                for policy in (p for p in self.policies if p != "full"):
                    for budget in self.budgets_of(policy):
                        out.append({"kind": "engine", "policy": policy, "budget": budget, "batch": batch,
                                    "length": length})
        return out

    def to_dict(self) -> dict:
        return asdict(self)


def _is_int(value, low: int) -> bool:
    return as_int(value) is not None and value >= low


def _plain(value):
    """A numpy integer or float as a Python int or float (the config is written as JSON), also inside a list or a
    mapping's values; a numpy bool stays as it is, for the checks to refuse; any other value as it is."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {key: _plain(v) for key, v in value.items()}
    return plain(value)


def _no_duplicates(name: str, values: list) -> None:
    twice = sorted({repr(v) for v in values if values.count(v) > 1})
    if twice:
        raise ValueError(f"{name}={values!r} lists {twice[0]} twice: list each once (each is measured once per "
                         "point of the sweep).")


def _nonempty_list(name: str, value, example: str) -> list:
    if not isinstance(value, list):
        value = [value]
    if not value:
        raise ValueError(f"{name} is empty: give at least one entry ({example}).")
    return value


def load_config(path: str | Path, overrides: list[str] | None = None) -> BenchConfig:
    """Read a flat YAML config and apply ``--field value`` overrides; errors name the file or the flag."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_bytes().decode("utf-8")) or {}
    except UnicodeDecodeError as err:
        raise ValueError(f"--config {path} is not UTF-8 text (byte {err.start}: {err.reason}); save it as UTF-8.") \
            from None
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"--config {path}: cannot read the bench config ({err}).") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: a bench config is a flat mapping of field names, "
                         f"got {type(data).__name__}.")
    known = {f.name for f in fields(BenchConfig)}
    given = parse_overrides(overrides or [])
    for where, keys in ((str(path), data), ("the --FIELD overrides", given)):  # name where the typo is
        unknown = sorted(set(keys) - known)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; the fields are {sorted(known)} "
                             "(kvroll bench --help lists them).")
    data.update(given)
    return BenchConfig(**data)


def parse_overrides(items: list[str]) -> dict:
    """``['--budgets', '[64, 128]', '--hf_generate=false']`` -> {'budgets': [64, 128], 'hf_generate': False}."""
    import yaml

    lists = ("policies", "budgets", "batch_sizes", "output_lengths", "hf_new_tokens")
    out, i = {}, 0
    while i < len(items):
        key = items[i]
        if not key.startswith("--"):
            raise ValueError(f"unexpected argument {key!r}: overrides are '--field value' pairs, e.g. --batch_sizes 4.")
        key, eq, raw = key[2:].partition("=")
        if not eq:
            if i + 1 >= len(items):
                raise ValueError(f"--{key} has no value: write '--{key} VALUE'.")
            raw, i = items[i + 1], i + 1
        key = key.replace("-", "_")
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
            if key in lists and not isinstance(value, (list, dict)):
                value = [yaml.safe_load(v) for v in str(raw).split(",") if v.strip()]
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ValueError(f"--{key} {raw!r} is not a valid YAML value ({problem}); e.g. --{key} 64 or "
                             f"--{key} '[64, 128]'.") from None
        out[key] = value
        i += 1
    return out


def help_text() -> str:
    """The fields and their help, for ``kvroll bench --help``."""
    return "\n".join(f"  --{f.name}: {f.metadata['help']}" for f in fields(BenchConfig))
