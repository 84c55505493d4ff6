"""Each strategy setting is declared once (``exogym.strategy.settings``) and that one
declaration is what the constructors default to and check, what the registry and the
planner read, and what the documentation's table shows.

The scan of the strategy modules fails when a setting is declared a second time: a
constructor argument with a literal default, or a range check written outside the
declarations.
"""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from exogym.strategy import facts, registry, settings
from exogym.strategy.settings import CountOrFraction, Setting

ROOT = Path(__file__).resolve().parents[1]
STRATEGY_DIR = ROOT / "exogym" / "strategy"
BUILT_IN = [name for name, known in registry.KNOWN.items() if known.home]

#: Classes whose arguments are not strategy settings: MuonAdamW is a torch optimizer, given
#: its hyperparameters through an ``OptimSpec``; RankContext holds what a run tells a rank
#: (its steps, its seed).
NOT_SETTINGS = {"MuonAdamW", "RankContext"}


def default_in_signature(cls: type, name: str) -> Any:
    """The default of ``cls``'s argument ``name``: its own constructor's, or the first base's
    that takes it (MuLoCo passes the outer optimizer's arguments on to DiLoCo)."""
    for klass in cls.__mro__:
        parameters = inspect.signature(klass.__init__).parameters
        if name in parameters:
            return parameters[name].default
    raise AssertionError(f"{cls.__name__} takes no {name!r}")


def made(cls: type, **kwargs: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(**kwargs)


# --------------------------------------------------------------------------- defaults


@pytest.mark.parametrize("name", BUILT_IN)
def test_every_constructor_default_is_the_declared_one(name):
    cls = registry.class_of(name)
    for setting in registry.KNOWN[name].settings:
        default = default_in_signature(cls, setting.name)
        if default is None and setting.default is not None:
            # None: "not given" (SPARTA's p_sparta may come from its selector, DeMo's lr from
            # optim_spec); what the strategy then takes is the declared default.
            default = getattr(made(cls), setting.name)
        assert (type(default), default) == (type(setting.default), setting.default), \
            (name, setting.name, default, setting.default)


def test_the_parts_strategies_are_built_of_default_to_the_same_declarations():
    """Communicators, selectors, DeMo's optimizer and the outer optimizer take the same
    settings as the strategies; their defaults are the same declarations."""
    from exogym.strategy.demo import DeMo
    from exogym.strategy.desloc import DESLOCCommunicator
    from exogym.strategy.diloco import DiLoCoCommunicator
    from exogym.strategy.federated_averaging import AveragingCommunicator
    from exogym.strategy.outer import OuterOptimizer
    from exogym.strategy.sparseloco import SparseLoCoCommunicator
    from exogym.strategy.sparta import (
        PartitionedIndexSelector,
        RandomIndexSelector,
        ShuffledSequentialIndexSelector,
        SparseCommunicator,
    )
    from exogym.strategy.streaming_diloco import StreamingDiLoCoCommunicator

    parts = [
        (DiLoCoCommunicator, settings.DILOCO, {"comm_dtype": "comm_dtype",
                                               "error_feedback": "error_feedback"}),
        (AveragingCommunicator, settings.FEDAVG, {n: n for n in settings.FEDAVG.names}),
        (SparseLoCoCommunicator, settings.SPARSELOCO, {n: n for n in settings.SPARSELOCO.names}),
        (DESLOCCommunicator, settings.DESLOC, {n: n for n in settings.DESLOC.names}),
        (StreamingDiLoCoCommunicator, settings.STREAMING_DILOCO,
         {n: n for n in ("fragment_delay", "fragment_alpha", "comm_dtype", "error_feedback")}),
        (SparseCommunicator, settings.SPARTA_DILOCO,
         {"interval": "sparta_interval", "comm_dtype": "comm_dtype"}),
        (RandomIndexSelector, settings.SPARTA, {"p": "p_sparta"}),
        (ShuffledSequentialIndexSelector, settings.SPARTA, {"p": "p_sparta"}),
        (PartitionedIndexSelector, settings.SPARTA, {"p": "p_sparta"}),
        (DeMo, settings.DEMO, {n: n for n in settings.DEMO.names}),
    ]
    for cls, group, arguments in parts:
        parameters = inspect.signature(cls.__init__).parameters
        for argument, name in arguments.items():
            assert parameters[argument].default == group[name].default, (cls.__name__, argument)
    outer = inspect.signature(OuterOptimizer.from_args).parameters
    assert (outer["outer_lr"].default, outer["outer_momentum"].default,
            outer["nesterov"].default) == (settings.DILOCO.outer_lr.default,
                                           settings.DILOCO.outer_momentum.default,
                                           settings.DILOCO.nesterov.default)
    assert (OuterOptimizer().lr, OuterOptimizer().momentum, OuterOptimizer().nesterov) == (
        settings.DILOCO.outer_lr.default, settings.DILOCO.outer_momentum.default,
        settings.DILOCO.nesterov.default)


def test_every_declared_default_is_a_value_its_setting_accepts():
    for group in settings.ALL:
        for setting in group:
            assert setting.accepts(setting.default), (group.strategy, setting.name)


def test_the_named_constants_of_facts_are_the_declared_defaults():
    """``facts.DILOCO_H`` and the rest stay importable for their readers (the benches),
    read from the declarations, not written again."""
    constants = {
        "DILOCO_H": settings.DILOCO.H, "FEDAVG_H": settings.FEDAVG.H,
        "ASYNC_QUORUM": settings.ASYNC_DILOCO.quorum,
        "ASYNC_GRACE_S": settings.ASYNC_DILOCO.grace_s,
        "ASYNC_MAX_STALENESS": settings.ASYNC_DILOCO.max_staleness,
        "SPARTA_P": settings.SPARTA.p_sparta,
        "SPARTA_INTERVAL": settings.SPARTA_DILOCO.sparta_interval,
        "DEMO_TOPK": settings.DEMO.compression_topk, "DEMO_CHUNK": settings.DEMO.compression_chunk,
        "SPARSELOCO_H": settings.SPARSELOCO.H, "SPARSELOCO_CHUNK": settings.SPARSELOCO.chunk,
        "SPARSELOCO_TOPK": settings.SPARSELOCO.topk,
        "SPARSELOCO_QUANT_BITS": settings.SPARSELOCO.quant_bits,
        "STREAMING_FRAGMENTS": settings.STREAMING_DILOCO.num_fragments,
        "DESLOC_H_PARAMS": settings.DESLOC.H_params, "DESLOC_H_M1": settings.DESLOC.H_m1,
        "DESLOC_H_M2": settings.DESLOC.H_m2, "MULOCO_COMM_DTYPE": settings.MULOCO.comm_dtype,
    }
    for name, setting in constants.items():
        assert getattr(facts, name) == setting.default, name
    tree = ast.parse((STRATEGY_DIR / "facts.py").read_text())
    written = [node.targets[0].id for node in tree.body
               if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
               and node.targets[0].id in constants and is_literal(node.value)]
    assert written == [], f"facts.py writes these defaults again: {written}"


# --------------------------------------------------------------------------- declared once


def is_literal(node: ast.AST | None) -> bool:
    """A value written in the source (``100``, ``-1``, ``3 * 100``, ``'random'``), not None."""
    if isinstance(node, ast.Constant):
        return node.value is not None and node.value is not Ellipsis
    if isinstance(node, ast.UnaryOp):
        return is_literal(node.operand)
    if isinstance(node, ast.BinOp):
        return is_literal(node.left) and is_literal(node.right)
    if isinstance(node, (ast.Tuple, ast.List)):
        return bool(node.elts) and all(is_literal(e) for e in node.elts)
    return False


def message_text(node: ast.AST) -> str:
    """The written words of a raised error's message, ``{}`` where a value is put in."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(message_text(v) if isinstance(v, ast.Constant) else "{}"
                       for v in node.values)
    if isinstance(node, ast.BinOp):  # "..." + "..."
        return message_text(node.left) + message_text(node.right)
    if isinstance(node, ast.Call):
        return " ".join(message_text(a) for a in node.args)
    return ""


class Redeclarations(ast.NodeVisitor):
    """Settings declared again in one module's source: constructor arguments (and public
    dataclass fields) with a literal default, and single-setting range checks.

    Args:
        source: the module's text.
        declared: every declared setting's name.
        exempt_raises: per class name, the setting names its own range checks may name
            (the base ``Strategy``'s arguments, which every strategy takes).
    """

    def __init__(self, source: str, declared: set[str],
                 exempt_raises: dict[str, set[str]] | None = None):
        self.declared = declared
        self.exempt_raises = exempt_raises or {}
        self.found: list[str] = []
        self.classes: list[str] = []
        self.visit(ast.parse(source))

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        if node.name in NOT_SETTINGS:
            return
        self.classes.append(node.name)
        dataclass = any("dataclass" in ast.unparse(d) for d in node.decorator_list)
        if dataclass and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and is_literal(item.value):
                    self.found.append(f"line {item.lineno}: {node.name}."
                                      f"{ast.unparse(item.target)} = {ast.unparse(item.value)}")
        self.generic_visit(node)
        self.classes.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        if node.name in ("__init__", "from_args") and self.classes:
            args = node.args
            positional = args.posonlyargs + args.args
            pairs = [*zip(positional[len(positional) - len(args.defaults):], args.defaults),
                     *zip(args.kwonlyargs, args.kw_defaults)]
            for arg, default in pairs:
                if is_literal(default):
                    self.found.append(f"line {node.lineno}: {self.classes[-1]}.{node.name}"
                                      f"({arg.arg}={ast.unparse(default)})")
        self.generic_visit(node)

    def visit_Raise(self, node: ast.Raise) -> None:
        text = message_text(node.exc) if node.exc is not None else ""
        exempt = set().union(*(self.exempt_raises.get(c, set()) for c in self.classes))
        for name in sorted(self.declared - exempt):
            if not re.search(rf"(?<![\w.]){re.escape(name)} must be", text):
                continue
            others = {n for n in self.declared - {name} if re.search(rf"\b{re.escape(n)}\b", text)}
            if not others:  # a check naming two settings ties them together: the constructor's
                self.found.append(f"line {node.lineno}: a range check of {name}: {text!r}")
        self.generic_visit(node)


def declared_names() -> set[str]:
    return {setting.name for group in settings.ALL for setting in group}


def base_strategy_arguments() -> set[str]:
    from exogym.strategy.strategy import Strategy

    return set(inspect.signature(Strategy.__init__).parameters) - {"self", "kwargs"}


def test_no_strategy_module_declares_a_setting_a_second_time():
    exempt = {"Strategy": base_strategy_arguments()}
    found = []
    for path in sorted(STRATEGY_DIR.glob("*.py")):
        if path.name == "settings.py":
            continue
        scan = Redeclarations(path.read_text(), declared_names(), exempt)
        found += [f"{path.name} {where}" for where in scan.found]
    assert found == [], ("declared in exogym/strategy/settings.py, written again:\n  "
                         + "\n  ".join(found))


def test_the_scan_finds_a_default_and_a_range_check_written_twice():
    """What the scan above would report, were a setting declared in a strategy's module."""
    source = '''
class TwiceStrategy:
    def __init__(self, H: int = 100, topk: int = -1, comm_dtype: str = "int8",
                 p: float = 3 * 0.1, named: int = SOMEWHERE.default, spec=None):
        if H < 1:
            raise ValueError(f"{type(self).__name__}: H must be an integer >= 1, got {H!r}")
        if merge_delay >= H:
            raise ValueError(f"merge_delay must be an integer with 0 <= merge_delay < H={H}")

@dataclass(frozen=True)
class Outer:
    lr: float = 0.7
'''
    found = Redeclarations(source, {"H", "topk", "comm_dtype", "merge_delay", "lr"}).found
    assert [f.split(": ", 1)[1] for f in found] == [
        "TwiceStrategy.__init__(H=100)", "TwiceStrategy.__init__(topk=-1)",
        "TwiceStrategy.__init__(comm_dtype='int8')", "TwiceStrategy.__init__(p=3 * 0.1)",
        "a range check of H: '{}: H must be an integer >= 1, got {}'",
        "Outer.lr = 0.7",
    ]


# --------------------------------------------------------------------------- checks


def bad_values(setting: Setting) -> list[Any]:
    """Values ``setting`` refuses: past each bound, of another type, not a choice."""
    if isinstance(setting, CountOrFraction):
        return [0, 1.5, "half"]
    if setting.kind is bool:
        return ["yes", 3]
    if setting.kind is str:
        return ["no-such-choice", 3]
    bad: list[Any] = ["x"]
    if setting.low is not None:
        bad.append(setting.low if setting.low_open else setting.low - 1)
    if setting.high is not None:
        bad.append(setting.high if setting.high_open else setting.high + 1)
    if setting.kind is int:
        bad.append(2.5)
    return bad


@pytest.mark.parametrize("name", BUILT_IN)
def test_every_setting_refuses_an_out_of_range_value_naming_it_and_its_range(name):
    cls = registry.class_of(name)
    for setting in registry.KNOWN[name].settings:
        for value in bad_values(setting):
            with pytest.raises(ValueError) as refused:
                made(cls, **{setting.name: value})
            message = str(refused.value)
            assert message.startswith(f"{cls.__name__}: {setting.name}"), (setting.name, message)
            assert repr(value) in message, (setting.name, value, message)
            if not (isinstance(setting, CountOrFraction) and isinstance(value, float)):
                assert f"{setting.name} must be {setting.valid}, got {value!r}" in message, \
                    message
            else:
                assert "must be in (0, 1]" in message, message


def test_a_setting_checks_against_its_declaration():
    h = settings.DILOCO.H
    assert h.valid == "an integer >= 1 (steps)"
    with pytest.raises(ValueError, match=r"^DiLoCoStrategy: H must be an integer >= 1 \(steps\), "
                                         r"got 0$"):
        h.check(0, "DiLoCoStrategy")
    for refused in (True, 1.0, "10", None):
        assert not h.accepts(refused), refused
    quant = settings.SPARSELOCO.quant_bits
    assert quant.accepts(None) and quant.accepts(8) and not quant.accepts(9)
    assert quant.valid == "an integer from 1 to 8, or None (float32)"
    comm_dtype = settings.DILOCO.comm_dtype
    assert all(comm_dtype.accepts(v) for v in ("bf16", "BFLOAT16", "half", "int4"))
    assert not comm_dtype.accepts("int3") and not comm_dtype.accepts(4)
    grace = settings.ASYNC_DILOCO.grace_s
    assert grace.valid == "a number of seconds >= 0"
    assert not grace.accepts(float("inf")) and not grace.accepts(float("nan"))
    assert settings.DILOCO.outer_momentum.valid == "a number in [0, 1)"
    # A selector's p is SPARTA's p_sparta, under the selector's own name for it.
    with pytest.raises(ValueError, match=r"^Owner: p must be a number in \[0, 1\], got 2$"):
        settings.SPARTA.p_sparta.check(2, "Owner", name="p")


def test_the_choices_the_classes_know_are_the_declared_ones():
    from exogym.strategy.async_diloco import WEIGHTINGS
    from exogym.strategy.sparta import SELECTORS

    assert set(SELECTORS) == set(settings.SPARTA.index_selector.choices)
    assert {cls.name for cls in SELECTORS.values()} == set(SELECTORS)
    assert WEIGHTINGS == settings.ASYNC_DILOCO.weighting.choices


# --------------------------------------------------------------------------- readers


def test_the_registry_and_the_planners_defaults_are_the_declarations():
    from distributed.planning.projection import DEFAULTS

    assert sorted(id(known.settings) for known in registry.KNOWN.values()) == sorted(
        id(group) for group in settings.ALL)
    for name, known in registry.KNOWN.items():
        declared = {s.name: s.default for s in known.settings if s.traffic}
        assert known.traffic_defaults == declared, name
        assert DEFAULTS[name] == declared, name
        if known.home:  # what the planner refuses to guess is among what it reads
            assert set(registry.class_of(name).traffic_needs) <= set(declared), name


def test_the_planner_checks_a_setting_against_its_declaration():
    from distributed.planning.projection import bytes_per_step

    with pytest.raises(ValueError, match=r"^diloco: H must be an integer >= 1 \(steps\), got 0$"):
        bytes_per_step("diloco", 1000, 2, H=0)
    with pytest.raises(ValueError, match=r"^diloco needs H \(inner steps per round\): "
                                         r"an integer >= 1 \(steps\)$"):
        bytes_per_step("diloco", 1000, 2)
    with pytest.raises(ValueError, match=r"^sparta: p_sparta must be a number in \[0, 1\]"):
        bytes_per_step("sparta", 1000, 2, p_sparta=1.5)


def test_profiles_name_strategies_as_the_registry_does():
    from distributed.profiles.profile import ProfileError, builtin_strategy, strategy_class

    for alias, name in registry.ALIASES.items():
        assert builtin_strategy(alias) == name
        assert strategy_class(alias) is registry.class_of(name)
    for name in BUILT_IN:
        assert strategy_class(name.replace("_", "-").upper()) is registry.class_of(name)
    assert builtin_strategy("none") is None  # no class: a profile cannot train with it
    assert builtin_strategy("mypkg.strategies:Mine") is None
    with pytest.raises(ProfileError, match="unknown strategy 'none'"):
        strategy_class("none")


@pytest.mark.parametrize("name", BUILT_IN)
def test_every_declared_setting_is_a_profile_key_of_its_strategy(name):
    """Profiles route a key to the strategy whose constructor takes it: each declared
    setting is one (MuLoCo's outer settings through DiLoCo's constructor)."""
    from distributed.profiles.profile import KeyRouting

    routing = KeyRouting.of(lambda **kwargs: None, registry.class_of(name))
    missing = [s.name for s in registry.KNOWN[name].settings if s.name not in routing.strategy_args]
    assert missing == [], name


def test_the_strategies_page_shows_the_table_the_declarations_render():
    page = (ROOT / "docs" / "strategies.md").read_text()
    start = "<!-- settings table: generated by python -m exogym.strategy.settings -->\n"
    end = "<!-- end of the settings table -->"
    assert start in page and end in page
    shown = page[page.index(start) + len(start):page.index(end)]
    assert shown == settings.markdown_table(), (
        "docs/strategies.md's settings table is not the declarations': paste the output of "
        "python -m exogym.strategy.settings between its markers")


def test_the_table_prints_from_the_command_line_without_torch():
    code = ("import runpy, sys\n"
            "runpy.run_module('exogym.strategy.settings', run_name='__main__')\n"
            "print('torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == settings.markdown_table() + "False\n"
