"""The optimizer registry: an optimizer is one module registering an `Optimizer`, and nothing
else names it. A toy optimizer registered from this file alone is counted by `memory` (its
states per parameter and per tensor, its step's temporaries, its state tensors in the
allocator replay); bitsandbytes' paged optimizers keep their large states in CUDA unified
memory, outside the device's peak, on their own line."""

from __future__ import annotations

import ast
import math
import warnings
from pathlib import Path
from typing import ClassVar

import pytest
from click.testing import CliRunner

from gptcalc.cli import cli
from gptcalc.errors import ConfigError
from gptcalc.inventory import inventory
from gptcalc.memory import memory_report
from gptcalc.memory.ledger import OPTIMIZER_STATES, OPTIMIZER_TEMPORARIES, Phase
from gptcalc.memory.peak import stage_ledger
from gptcalc.memory.reserved import step_events
from gptcalc.memory.states import unified_optimizer_bytes
from gptcalc.optimizers import Optimizer, names, optimizer_named, register, unregister
from gptcalc.optimizers.bnb import PAGED_MIN_ELEMENTS
from gptcalc.presets import from_name
from gptcalc.training_setup import TrainingSetup
from gptcalc.workload import Workload

CFG = from_name("gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=256, block_size=64)
WL = Workload(2, 32)


class ThreeMoments(Optimizer):
    """A toy: three fp32 moments per element, a 0-d fp32 counter per tensor, and an update
    that makes one fp32 copy of the tensor it steps."""

    name = "toy-three-moments"
    help = "a test's optimizer"
    state_tensors: ClassVar[int] = 3
    step_counter_bytes: ClassVar[int] = 4

    def per_param_bytes(self, mode: str) -> int:
        return 12

    def update_temporaries(self, n: int, device: str, param_bytes: int) -> int:
        return 4 * n


class AdamWAgain(Optimizer):
    """A toy that declares what AdamW declares (fp32 moments, a float32 step, the foreach
    temporaries on CUDA; on CPU, one tensor at a time, the previous tensor's temporary beside
    this one's two), under another name."""

    name = "toy-adamw"
    help = "a test's optimizer"
    state_tensors: ClassVar[int] = 2
    step_counter_bytes: ClassVar[int] = 4

    def per_param_bytes(self, mode: str) -> int:
        return {"fp32": 8, "amp": 8, "mixed": 12, "bf16": 4}[mode]

    def update_temporaries(self, n: int, device: str, param_bytes: int) -> int:
        return param_bytes * n * (1 if device == "cuda" else 2)

    def step_temporaries(self, step) -> int:
        if step.device == "cuda":
            return self.update_temporaries(step.stepped, "cuda", step.param_bytes)
        return max(prev + 2 * n for prev, n in step.pairs()) * step.param_bytes


@pytest.fixture
def toys():
    for toy in (ThreeMoments(), AdamWAgain()):
        register(toy)
    yield
    for toy in ("toy-three-moments", "toy-adamw"):
        unregister(toy)


def test_a_toy_is_an_option_once_registered(toys):
    assert "toy-three-moments" in names()
    TrainingSetup(optimizer="toy-three-moments")  # accepted
    unregister("toy-three-moments")
    with pytest.raises(ConfigError) as e:
        TrainingSetup(optimizer="toy-three-moments")
    assert e.value.field == "optimizer"
    register(ThreeMoments())


def test_a_name_twice_raises(toys):
    with pytest.raises(ValueError):
        register(ThreeMoments())


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_memory_counts_the_toys_states_and_temporaries(toys, device):
    setup = TrainingSetup(optimizer="toy-three-moments", device=device)
    rep = memory_report(CFG, WL, setup)
    tensors = inventory(CFG)
    n = sum(t.elements for t in tensors)
    largest = max(t.numel for t in tensors)
    # 12 bytes per element and 4 per tensor, as the toy declares
    assert rep.optimizer == 12 * n + 4 * sum(t.count for t in tensors)
    ledger = stage_ledger(CFG, WL, setup, "first")
    assert ledger.get(Phase.OPTIMIZER_STEP, OPTIMIZER_STATES) == rep.optimizer
    # one tensor at a time, the largest: one fp32 copy of it
    assert ledger.get(Phase.OPTIMIZER_STEP, OPTIMIZER_TEMPORARIES) == 4 * largest
    # the replay makes its three state tensors per parameter tensor in the first step
    states = {k[0] for kind, k, *_ in step_events(CFG, WL, setup)
              if kind == "alloc" and isinstance(k, tuple) and str(k[0]).startswith("state")}
    assert states == {"state0", "state1", "state2"}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("mode", ["fp32", "amp", "mixed", "bf16"])
def test_a_toy_declaring_adamw_answers_as_adamw(toys, device, mode):
    def report(optimizer):
        rep = memory_report(CFG, WL, TrainingSetup(optimizer=optimizer, device=device,
                                                   mode=mode))
        return (rep.optimizer, rep.peak.bytes, rep.peak.phases, rep.resident)
    assert report("toy-adamw") == report("adamw")


def test_an_unshardable_optimizer_is_refused_where_an_engine_shards():
    with pytest.raises(ConfigError) as e:
        memory_report(CFG, WL, TrainingSetup(optimizer="muon", zero=1, dp=2))
    assert e.value.field == "optimizer"


# bitsandbytes' get_state_buffer: paged (unified) only for tensors of 10^5 elements or more
@pytest.mark.parametrize("n,paged", [(PAGED_MIN_ELEMENTS - 1, False), (PAGED_MIN_ELEMENTS, True)])
@pytest.mark.parametrize("optimizer,per_element", [("paged_adamw", 8), ("paged_adamw8bit", 2)])
def test_paged_states_from_ten_to_the_fifth_elements_on_cuda(n, paged, optimizer, per_element):
    cuda = TrainingSetup(optimizer=optimizer, device="cuda")
    assert unified_optimizer_bytes(cuda, [((n,), 3)]) == (3 * per_element * n if paged else 0)
    # on CPU bitsandbytes falls back to ordinary tensors
    assert unified_optimizer_bytes(TrainingSetup(optimizer=optimizer), [((n,), 3)]) == 0


def test_paged_states_leave_the_device_peak_and_have_their_own_line():
    big = from_name("gpt2", n_layer=2)  # 768 x 768 matrices: above 10^5 elements
    wl = Workload(1, 64)

    def report(optimizer):
        return memory_report(big, wl, TrainingSetup(optimizer=optimizer, device="cuda"))
    plain, paged = report("adamw8bit"), report("paged_adamw8bit")
    unified = paged.unified["unified memory (paged optimizer states)"]
    large = [t for t in inventory(big) if t.numel >= PAGED_MIN_ELEMENTS]
    assert large and unified == sum(2 * t.numel * t.count for t in large)  # uint8 state1, state2
    assert paged.optimizer == plain.optimizer - unified
    assert paged.peak.bytes == plain.peak.bytes - unified
    assert plain.unified == {}
    out = CliRunner().invoke(cli, ["memory", "--preset", "gpt2", "-L", "2", "--seq-len", "64",
                                   "-B", "1", "--device", "cuda", "--optimizer",
                                   "paged_adamw8bit"])
    assert out.exit_code == 0, out.output
    assert "unified memory (paged optimizer states)" in out.output
    assert f"{unified:,}" in out.output


def test_paged_adamw_keeps_fp32_states_in_every_mode():
    # PagedAdamW's 32-bit states are fp32 in every mode; its step is a Python int
    rep = memory_report(CFG, WL, TrainingSetup(optimizer="paged_adamw", mode="bf16"))
    n = sum(t.elements for t in inventory(CFG))
    assert rep.optimizer == 8 * n and rep.unified == {}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(4095,), (63, 64), (3, 5, 7), (1,)])
def test_paged_adamw_states_equal_bitsandbytes(dtype, shape):
    """PagedAdamW (32-bit) stepped on CPU, where it falls back to ordinary tensors: its
    state's unique storages against `tensor_state_bytes` (no 0-d step tensor)."""
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    p = torch.nn.Parameter(torch.randn(*shape, dtype=getattr(torch, dtype)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # paged optimizers on CPU: unpaged, with a warning
        opt = bnb.optim.PagedAdamW([p], lr=1e-3)
        p.grad = torch.randn_like(p)
        opt.step()
    seen = {}
    for v in opt.state[p].values():
        if torch.is_tensor(v):
            seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    mode = "bf16" if dtype == "bfloat16" else "fp32"
    optimizer = optimizer_named("paged_adamw")
    assert sum(seen.values()) == (optimizer.tensor_state_bytes(shape, mode)
                                  + optimizer.step_counter_bytes)
    assert sum(seen.values()) == 8 * math.prod(shape)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [63, 64, 1024])  # both sides of min_8bit_size: one 32-bit path
def test_paged_adamw_update_temporaries_equal_the_allocator(dtype, rows):
    """PagedAdamW's CPU update (`_optimizer_update_32bit_cpu`) against the CPU allocator's
    peak over one step (test_optimizers' `allocator_peak`)."""
    torch = pytest.importorskip("torch")
    bnb = pytest.importorskip("bitsandbytes")
    from .test_optimizers import allocator_peak

    n, pb = rows * 64, 2 if dtype == "bfloat16" else 4
    p = torch.nn.Parameter(torch.randn(rows, 64, dtype=getattr(torch, dtype)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = bnb.optim.PagedAdamW([p], lr=1e-3)
        p.grad = torch.randn_like(p)
        opt.step()  # the states exist before the measured step
        measured = allocator_peak(opt)
    predicted = optimizer_named("paged_adamw").update_temporaries(n, "cpu", pb)
    # beside the formula: what the adamw8bit twin finds after its peak (test_optimizers)
    assert measured - predicted in range(0, 16)


# Where a default optimizer may be written: the registry itself (`optimizers.DEFAULT`) and the
# recipe readers, which map a framework's optimizer names onto gptcalc's.
NAMING_PACKAGES = ("optimizers", "recipes")


def optimizer_defaults(source: str) -> list[tuple[int, str]]:
    """(line, name) of every optimizer name written as a default in `source`: a `default=`
    or `optimizer=` keyword, a parameter's default, an `"optimizer": ...` dict entry, or a
    class field or assignment named `optimizer`."""
    known = set(names())

    def named(node: ast.AST | None) -> str | None:
        ok = isinstance(node, ast.Constant) and node.value in known
        return node.value if ok else None

    found = []
    for node in ast.walk(ast.parse(source)):
        values: list[ast.AST | None] = []
        if isinstance(node, ast.keyword) and node.arg in ("default", "optimizer"):
            values = [node.value]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            values = [*node.args.defaults, *node.args.kw_defaults]
        elif isinstance(node, ast.Dict):
            values = [v for k, v in zip(node.keys, node.values)
                      if isinstance(k, ast.Constant) and k.value == "optimizer"]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and "optimizer" in t.id.lower() for t in targets):
                values = [node.value]
        found += [(v.lineno, n) for v in values if (n := named(v))]
    return found


def test_the_default_optimizer_is_written_in_the_registry_only():
    package = Path(__file__).resolve().parent.parent / "gptcalc"
    written = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package).parts
        if parts[0] in NAMING_PACKAGES:
            continue
        for line, name in optimizer_defaults(path.read_text()):
            written[f"{'/'.join(parts)}:{line}"] = name
    assert written == {}, "read gptcalc.optimizers.DEFAULT instead"


@pytest.mark.parametrize("source", [
    'click.option("--optimizer", default="adamw")',
    'def f(optimizer="sgd"): pass',
    'd = {"optimizer": "adamw", "mode": "bf16"}',
    'class S:\n    optimizer: str = "lion"',
    'DEFAULT_OPTIMIZER = "adamw"',
    'TrainingSetup(optimizer="muon")',
])
def test_the_default_check_finds_a_written_default(source):
    assert [name for _, name in optimizer_defaults(source)] != []


@pytest.mark.parametrize("source", [
    'click.option("--optimizer", default=DEFAULT)',
    'if setup.optimizer != "adamw": pass',  # a fact of AdamW, not a default
    'd = {"optimizer": DEFAULT, "mode": "adamw"}',
])
def test_the_default_check_passes_a_default_read_from_the_registry(source):
    assert optimizer_defaults(source) == []


def test_the_defaults_read_the_registry():
    from gptcalc.optimizers import DEFAULT
    from gptcalc.training import training_table_defaults
    from gptcalc.cli.verify import command as verify
    assert names()[0] == DEFAULT == "adamw"  # the optimizer most training runs use
    assert training_table_defaults(CFG)["optimizer"] == DEFAULT
    assert TrainingSetup().optimizer == DEFAULT
    assert next(p for p in verify.params if p.name == "optimizer").default == DEFAULT
