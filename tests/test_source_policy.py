"""The source policy (grader/sandbox/source_policy.py): each rule on small examples, honest and hostile; the stubs, the
reference and every wrong implementation pass it; what it lets an honest student import, as the handout prints it;
and, graded end to end, each cheat it exists for loses its own points before any of its code runs.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from assignment.registry import FAMILY_DEFAULTS, PROBLEMS
from grader.sandbox import source_policy
from tests import mutants
from tests.grading import ATTACKED_AND_BYSTANDER, ROOT, assert_fails_for, run_grader

HOSTILE = Path(__file__).resolve().parent / "hostile"
# The problem each family's examples are written as.
EXAMPLE_PROBLEM = {"kernels": "kernels.softmax", "attention": "attention.mla", "moe": "moe.router",
                   "parallel": "parallel.ddp"}


def found_in(tmp_path: Path, source: str, family: str = "kernels", others: dict[str, str] | None = None) -> list[str]:
    """The violations of a package named `impl` whose problem module (of `family`'s example problem) is `source`,
    beside `others` ({relative path: source})."""
    problem_id = EXAMPLE_PROBLEM[family]
    package = tmp_path / "impl"
    files = {f"{problem_id.replace('.', '/')}.py": source, **(others or {})}
    for relative, text in files.items():
        (package / relative).parent.mkdir(parents=True, exist_ok=True)
        (package / relative).write_text(textwrap.dedent(text))
    return [str(violation) for violation in source_policy.violations("impl", package, problem_id)]


# --- each rule --------------------------------------------------------------------------------------------------------

HONEST = {
    "the stubs' imports": """
        from __future__ import annotations
        import math
        from dataclasses import dataclass, field
        from typing import NamedTuple
        import torch
        import torch.nn.functional as F
        from torch import Tensor, nn
        import triton
        import triton.language as tl
        """,
    "a Triton kernel": """
        import torch
        import triton
        import triton.language as tl

        @triton.jit
        def _kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
            offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            tl.store(y_ptr + offsets, tl.exp(tl.load(x_ptr + offsets, mask=offsets < n)), mask=offsets < n)

        def softmax(x):
            y = torch.empty_like(x)
            _kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
            return y
        """,
    "a module with private state": """
        import torch

        class Cache(torch.nn.Module):
            def __init__(self, size: int):
                super().__init__()
                self._cache = {}
                self.__count = 0

            @classmethod
            def make(cls):
                cls._made = True
                return cls(1)

            def __repr__(self):
                return f"{type(self).__name__}({len(self._cache)})"
        """,
    "a dataclass": """
        from dataclasses import dataclass

        @dataclass
        class Config:
            width: int

            def __post_init__(self) -> None:
                if self.width < 1:
                    raise ValueError(f"width must be positive, got {self.width}")
        """,
    "getattr with a constant name": """
        def epsilon(config):
            return getattr(config, "eps", 1e-6) if hasattr(config, "eps") else 1e-6
        """,
    "locals() checking a function's arguments": """
        def count(layers: int, width: int) -> int:
            check_arguments(locals())
            return layers * width

        def check_arguments(arguments: dict) -> None:
            for name, value in arguments.items():
                if value < 1:
                    raise ValueError(f"{name} must be positive")
        """,
    "a parameter called input": """
        import torch

        def reduce_scatter(output: torch.Tensor, input: torch.Tensor) -> None:
            output.copy_(input[: output.numel()])
        """,
    "type(x).__name__ in an error": """
        import torch

        def check(x) -> None:
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"expected a tensor, got {type(x).__name__}")
        """,
    "torch's public API by attribute": """
        import torch

        class Square(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return x * x

        def capability(x):
            return torch.cuda.get_device_capability(x.device) if x.is_cuda else None
        """,
}


@pytest.mark.parametrize("source", HONEST.values(), ids=HONEST.keys())
def test_honest_idioms_pass(tmp_path, source):
    assert found_in(tmp_path, source) == []


REFUSED = {
    "ctypes": ("import ctypes\n", "softmax.py:1: imports ctypes: kernels problems may import only torch, "),
    "numpy": ("import numpy as np\n", "imports numpy"),
    "os from": ("from os import environ\n", "imports os"),
    "the grader": ("import grader.sandbox.guards\n", "imports grader.sandbox.guards"),
    "the reference": ("from reference.kernels.softmax import softmax\n", "imports reference.kernels.softmax"),
    "distributed outside parallel": ("from torch import distributed\n", "imports torch.distributed: kernels"),
    "a star import": ("from math import *\n", "imports * from math"),
    "torch._C": ("import torch\nwith torch._C._DisableTorchDispatch():\n    pass\n",
                 "softmax.py:2: reads torch._C: private and dunder attributes of modules and objects are off limits"),
    "a private module": ("from torch.nn import _reduction\n", "imports torch.nn._reduction: private"),
    "__globals__": ("import torch\nnamespace = torch.Tensor.tolist.__globals__\n",
                    "reads torch.Tensor.tolist.__globals__"),
    "__subclasses__": ("classes = object.__subclasses__()\n", "reads object.__subclasses__"),
    "__dict__": ("def f(x):\n    return x.__dict__\n", "reads x.__dict__"),
    "__builtins__": ("b = __builtins__\n", "uses __builtins__"),
    "__file__": ("where = __file__\n", "uses __file__"),
    "another object's private": ("def f(other):\n    return other._secret\n", "reads other._secret"),
    "super's attribute machinery": ("class A:\n    def f(self):\n        return super().__getattribute__('x')\n",
                                    "reads super().__getattribute__"),
    "torch.ops": ("import torch\ny = torch.ops.aten.exp\n", "reads torch.ops: torch's operators below"),
    "torch.library": ("import torch as t\nlib = t.library\n", "reads t.library"),
    "torch.utils": ("import torch\ntimer = torch.utils.benchmark.Timer\n", "uses torch.utils: its cpp_extension"),
    "torch.compile": ("import torch\nfast = torch.compile(torch.exp)\n", "uses torch.compile"),
    "triton.runtime": ("import triton\nbuild = triton.runtime.build\n", "uses triton.runtime"),
    "sys through dataclasses": ("import dataclasses\nmodules = dataclasses.sys.modules\n", "reads dataclasses.sys"),
    "numpy through torch.nn.functional": ("import torch.nn.functional as F\nnp = F.np\n", "reads F.np"),
    "a frame": ("def f():\n    g = (i for i in ())\n    return g.gi_frame.f_back\n", "reads g.gi_frame"),
    "a traceback's frame": ("class C:\n    def __exit__(self, kind, error, tb):\n        self.seen = tb.tb_frame\n",
                            "reads tb.tb_frame"),
    "the method resolution order": ("import torch\nbase = torch.Tensor.mro()[1]\n", "reads torch.Tensor.mro"),
    "exec": ("exec('x = 1')\n", "softmax.py:1: uses exec: exec, eval, compile"),
    "eval passed on": ("run = eval\n", "uses eval"),
    "compile with a Triton file name": ("code = compile('x = 1', 'triton/language/core.py', 'exec')\n",
                                        "uses compile"),
    "open": ("text = open('/etc/passwd').read()\n", "uses open"),
    "globals": ("namespace = globals()\n", "uses globals"),
    "locals at module level": ("namespace = locals()\n", "uses locals"),
    "locals passed on": ("def f():\n    return locals\n", "uses locals"),
    "vars": ("def f(x):\n    return vars(x)\n", "uses vars"),
    "__import__": ("os = __import__('os')\n", "uses __import__"),
    "input()": ("answer = input()\n", "uses input"),
    "getattr with a computed name": ("import torch\nC = getattr(torch, '_' + 'C')\n",
                                     "calls getattr with the name '_' + 'C': getattr, setattr, delattr and hasattr "
                                     "take a constant name"),
    "getattr with a private constant": ("import torch\nC = getattr(torch, '_C')\n", "reads torch._C"),
    "setattr with a computed name": ("def f(module, name, value):\n    setattr(module, name, value)\n",
                                     "calls setattr with the name name"),
    "getattr passed on": ("read = getattr\n", "uses getattr other than in a call"),
    "a module as a value": ("import torch\nt = torch\n", "uses the module torch as a value"),
    "a module passed on": ("import torch.nn.functional as F\ndef f(g=F):\n    return g\n",
                           "uses the module torch.nn.functional as a value"),
    "patching torch": ("import torch\ntorch.Tensor.tolist = None\n", "changes torch.Tensor.tolist: what you import"),
    "patching through setattr": ("import triton\nsetattr(triton, 'jit', None)\n", "changes triton.jit"),
    "deleting a method of an object's class": ("def f(x):\n    del type(x).numpy\n", "changes type(x).numpy"),
    "super past torch.Tensor": ("import torch\ndef f(x):\n    return super(torch.Tensor, x).tolist()\n",
                                "calls super(torch.Tensor, x): super() takes no arguments"),
    "a string annotation evaluated": ("def f(x: \"__import__('os')\"):\n    pass\n", "uses __import__"),
    "get_type_hints": ("import typing\nhints = typing.get_type_hints(len)\n", "reads typing.get_type_hints"),
    "a match on an attribute": ("def f(x):\n    match x:\n        case object(__globals__=g):\n            return g\n",
                                "reads object.__globals__"),
}


@pytest.mark.parametrize("source, fragment", REFUSED.values(), ids=REFUSED.keys())
def test_each_rule_refuses_its_example(tmp_path, source, fragment):
    found = found_in(tmp_path, source)
    assert any(fragment in violation for violation in found), found


def test_distributed_is_parallel_only(tmp_path):
    source = "import torch.distributed as dist\n"
    assert found_in(tmp_path / "parallel", source, "parallel") == []
    for family in ("kernels", "attention", "moe"):
        assert any("imports torch.distributed" in v for v in found_in(tmp_path / family, source, family)), family


def test_the_package_own_modules_are_checked_transitively(tmp_path):
    """What importing the problem runs is checked: its packages' __init__.py files and the package's modules it
    imports, relatively or under the package's name, each with its own file and line."""
    found = found_in(tmp_path, "from . import helper\nfrom impl.kernels.other import f\n", others={
        "__init__.py": "import os\n",
        "kernels/__init__.py": "",
        "kernels/helper.py": "from .deeper import _private\n",
        "kernels/deeper.py": "x = 1\nimport gc\n_private = 1\n",
        "kernels/other.py": "import torch\n\ndef f():\n    return torch._C\n",
        "moe/unrelated.py": "import ctypes\n",
    })
    assert sorted(v.split(": ")[0] for v in found) == ["__init__.py:1", "kernels/deeper.py:2", "kernels/other.py:4"]


def test_a_package_of_the_same_name_is_what_is_checked(tmp_path):
    """Python imports a folder with an __init__.py ahead of a module file of the same name."""
    found = found_in(tmp_path, "x = 1\n", others={"kernels/softmax/__init__.py": "import sys\n"})
    assert found and found[0].startswith("kernels/softmax/__init__.py:1: imports sys"), found


def test_a_compiled_module_is_refused(tmp_path):
    found = found_in(tmp_path, "from . import helper\n", others={"kernels/helper.py": "x = 1\n"})
    assert found == []
    (tmp_path / "impl" / "kernels" / "helper.abi3.so").write_bytes(b"\x7fELF")
    found = found_in(tmp_path, "from . import helper\n")
    assert found == [f"kernels/helper.abi3.so: {source_policy.COMPILED_RULE}"], found


def test_the_source_is_read_as_python_decodes_it(tmp_path):
    """A coding line changes what Python runs: in UTF-7, `+AAo-` is a line break that ends the comment before it."""
    package = tmp_path / "impl" / "kernels"
    package.mkdir(parents=True)
    (package / "softmax.py").write_bytes(b"# coding: utf-7\n# harmless +AAo-import os\n")
    found = [str(v) for v in source_policy.violations("impl", tmp_path / "impl", "kernels.softmax")]
    assert found and "imports os" in found[0], found


def test_a_file_that_does_not_parse_is_left_to_its_import(tmp_path):
    assert found_in(tmp_path, "def f(:\n") == []


# --- the stubs, the reference and every wrong implementation pass it -------------------------------------------------


@pytest.mark.parametrize("package", ["student_impl", "reference"])
def test_the_stubs_and_the_reference_pass(package):
    found = [f"{problem.id}: {violation}" for problem in PROBLEMS
             for violation in source_policy.violations(package, ROOT / package, problem.id)]
    assert found == [], "\n".join(found)


def test_every_wrong_implementation_passes(tmp_path):
    """Each mutant fails for its own bug, never for the policy: the ones whose bug is a way around a runtime guard
    (torch's DDP, numpy through ctypes) are graded with --source-policy off, which tests that guard."""
    package = shutil.copytree(ROOT / "reference", tmp_path / "impl", ignore=shutil.ignore_patterns("__pycache__"))
    found = []
    for mutant in mutants.discover():
        if "--source-policy" in mutant.grader_args:
            continue
        module = package / mutant.module_path
        original = module.read_text()
        module.write_text(mutant.source())
        found += [f"{mutant.id}: {violation}" for violation in source_policy.violations("impl", package,
                                                                                          mutant.problem)]
        module.write_text(original)
    assert found == [], "\n".join(found)


# --- what an honest student may import, as the handout says it ------------------------------------------------------


def imports_in(folder: Path) -> set[str]:
    """The modules outside their package that the files under `folder` import."""
    found = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                found.add(node.module)
    return found


@pytest.mark.parametrize("family", FAMILY_DEFAULTS)
def test_what_an_honest_student_may_import(family, capsys):
    """The handout's text (source_policy.describe) lists exactly the family's allowlist and names the refused modules;
    the allowlist covers every import of the family's stubs and reference."""
    text = source_policy.describe(family)
    with capsys.disabled():
        print(f"\n--- {family} ---\n{text}")
    listed = text.split("- Imports: only ", 1)[1].split(", and your package's own modules", 1)[0]
    assert [name.strip("` ") for name in listed.split(",")] == list(source_policy.FAMILY_IMPORTS[family])
    for module in source_policy.NAMED_REFUSED_MODULES:
        assert f"`{module}`" in text
    used = imports_in(ROOT / "student_impl" / family) | imports_in(ROOT / "reference" / family)
    assert used <= set(source_policy.FAMILY_IMPORTS[family]), used - set(source_policy.FAMILY_IMPORTS[family])
    assert not set(source_policy.NAMED_REFUSED_MODULES) & set(source_policy.FAMILY_IMPORTS[family])


def test_every_family_has_its_rules():
    assert set(source_policy.FAMILY_IMPORTS) == set(FAMILY_DEFAULTS)


# --- graded end to end ------------------------------------------------------------------------------------------------


def with_hostile_softmax(tmp_path: Path, variant: str) -> Path:
    impl = shutil.copytree(ROOT / "reference", tmp_path / "impl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(HOSTILE / variant / "kernels" / "softmax.py", impl / "kernels" / "softmax.py")
    return impl


@pytest.mark.parametrize("variant, fragments", [
    ("computes_in_numpy", ("kernels/softmax.py:5: imports ctypes", "kernels/softmax.py:7: imports numpy")),
    ("disables_dispatch", ("kernels/softmax.py:18: reads torch._C", "private and dunder attributes")),
    ("pops_the_modes", ("kernels/softmax.py:7: imports torch.utils._python_dispatch",)),
    ("compiled_as_triton", ("kernels/softmax.py:15: uses exec", "kernels/softmax.py:15: uses compile")),
    ("rewrites_reply", ("kernels/softmax.py:5: imports sys",)),
    ("reaches_globals", ("kernels/softmax.py:10: reads torch.Tensor.tolist.__globals__",)),
])
def test_each_cheat_loses_its_own_points_before_it_runs(tmp_path, variant, fragments):
    run = run_grader(with_hostile_softmax(tmp_path, variant), *ATTACKED_AND_BYSTANDER)
    assert_fails_for(run, "kernels.softmax", "matches_reference_fp32", *fragments)
    router = run.tests_of("moe.router")
    assert router and all(t["status"] == "passed" for t in router), run.output[-3000:]


def test_a_stub_is_not_implemented_whatever_it_imports(tmp_path):
    impl = shutil.copytree(ROOT / "student_impl", tmp_path / "impl", ignore=shutil.ignore_patterns("__pycache__"))
    module = impl / "kernels" / "softmax.py"
    module.write_text("import os\n" + module.read_text())
    run = run_grader(impl, "--problem", "kernels.softmax", "-k", "matches_reference_fp32")
    tests = run.tests_of("kernels.softmax")
    assert tests and all(t["output"] == "not implemented" for t in tests), run.output[-3000:]


def test_a_measured_problem_that_breaks_the_policy_fails_its_question(tmp_path):
    """parallel.analysis measures the student's pipeline: its question fails, naming the problem and the violation,
    before any rank starts."""
    impl = shutil.copytree(ROOT / "reference", tmp_path / "impl", ignore=shutil.ignore_patterns("__pycache__"))
    module = impl / "parallel" / "pipeline.py"
    module.write_text("import threading\n" + module.read_text())
    run = run_grader(impl, "--problem", "parallel.analysis", "-k", "measured_bubble")
    assert_fails_for(run, "parallel.analysis", "measured_bubble", "parallel.pipeline, which this question measures",
                     "parallel/pipeline.py:1: imports threading")


def test_the_grading_profile_refuses_to_switch_it_off():
    done = subprocess.run([sys.executable, "-m", "pytest", "grader", "-q", "-p", "no:cacheprovider", "--profile",
                           "grading", "--source-policy", "off", "-k", "nothing"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 4, done.stdout + done.stderr
    assert "the grading profile always checks it" in done.stdout + done.stderr
