"""The rules a submission's source must follow, checked on the source before any of it is imported.

The worker's rule checks (the operator recorder, the Triton launch hooks, the tamper check) live in the student's own
process, and each falls to one line of Python that reaches past them: torch computing inside
`torch._C._DisableTorchDispatch()`, code compiled with a file name inside Triton's package, tensors read through
`ctypes` and computed in numpy, the recorder replaced through `sys.modules` or a function's `__globals__`, the reply
pipe patched. Every one of those lines needs a module, an attribute or a builtin that the problems themselves never
need, so this module refuses them by reading the source (ast, never importing or running it) of the problem's module
and of every module of the package it imports, transitively, and of the packages' `__init__.py` files that importing
it runs. The rules are data, per family, and `describe` prints them for the handout.

Reading the source is evidence from outside the student's process. It closes the one-line routes, not every route:
Python has more of them than any list names, which is what the README's review of suspicious submissions is for.
"""

from __future__ import annotations

import ast
import importlib.machinery
from dataclasses import dataclass
from pathlib import Path

# --- the rules, as data (the handout prints them through `describe`) --------------------------------------------------

# What the stubs and the reference import, and standard modules that give no access to the process or to other code.
# `operator` and `string` are left out on purpose: attrgetter, methodcaller and string.Formatter read attributes named
# by run-time strings, which is getattr with a computed name.
COMMON_IMPORTS = ("torch", "torch.nn", "torch.nn.functional", "math", "dataclasses", "typing", "collections",
                  "collections.abc", "itertools", "functools", "copy", "__future__", "enum", "abc", "numbers",
                  "contextlib", "warnings", "time")
TRITON_IMPORTS = ("triton", "triton.language", "triton.language.extra", "triton.language.extra.libdevice")
FAMILY_IMPORTS = {
    "kernels": COMMON_IMPORTS + TRITON_IMPORTS,
    "attention": COMMON_IMPORTS + TRITON_IMPORTS,
    "moe": COMMON_IMPORTS,
    "parallel": COMMON_IMPORTS + ("torch.distributed",),
}
# Private names a family's honest code needs, by dotted path: torch's grouped GEMM, the fast path of an MoE layer, has
# no public name in every torch the course supports.
FAMILY_PRIVATE_PATHS = {"moe": ("torch._grouped_mm",)}
# Where setattr and delattr may take a name computed at run time: parameter surgery by name (a sharded unit drops its
# parameters and sets views in their place). They write attributes; they read none.
COMPUTED_SETTERS_FAMILIES = ("parallel",)
COMPUTED_SETTERS = ("setattr", "delattr")
# Named in every refusal's text, so that no student has to guess: each reaches the process, other code or raw memory.
NAMED_REFUSED_MODULES = ("ctypes", "gc", "inspect", "sys", "os", "multiprocessing", "importlib", "numpy", "subprocess",
                         "threading", "pickle", "marshal", "types", "builtins")

# Parts of torch and triton that run code this policy never reads, or compute below the recorders, by dotted path
# (followed through import aliases: `import torch as t; t.hub` is torch.hub).
REFUSED_PATHS = {
    "torch.utils": "its cpp_extension compiles C++, its benchmark runs statements given as strings, its collect_env "
                   "runs commands",
    "torch.hub": "it imports code from a folder",
    "torch.load": "it unpickles, which runs code",
    "torch.serialization": "it unpickles, which runs code",
    "torch.package": "it imports code from an archive",
    "torch.classes": "it loads compiled libraries",
    "torch.cuda.memory": "its pluggable allocator loads compiled libraries",
    "torch.cuda.CUDAPluggableAllocator": "it loads compiled libraries",
    "torch.jit": "it compiles and loads TorchScript",
    "torch.compile": "it generates and runs kernels that are not yours",
    "torch.fx": "it generates and runs Python code",
    "torch.export": "it traces and runs code of its own",
    "torch.multiprocessing": "it starts processes",
    "torch.distributed.rpc": "it runs functions on other ranks, past the collectives the problems record",
    "triton.runtime": "its build compiles and loads C",
    "triton.compiler": "it compiles code outside the @triton.jit decorator",
    "triton.compile": "it compiles code outside the @triton.jit decorator",
    "triton.backends": "its drivers compile and load C",
    "triton.testing": "its benchmarks call what they are given from Triton's own code",
    "triton.tools": "it compiles and links kernels outside the @triton.jit decorator",
}
# The same modules as other modules' attributes (torch.sys, dataclasses.sys, torch.nn.functional.np). Not `numpy`:
# that is also torch.Tensor's method, whose use in a Triton problem the worker judges.
MODULE_ATTRIBUTES = tuple(name for name in NAMED_REFUSED_MODULES if name != "numpy") + ("np",)
# Attributes that reach code which is not the student's: a frame's caller and namespaces, a generator's or traceback's
# frame, code objects, and a class's method resolution order (the unguarded base class of torch.Tensor).
FRAME_ATTRIBUTES = ("f_back", "f_globals", "f_locals", "f_builtins", "f_code", "gi_frame", "gi_code", "cr_frame",
                    "cr_code", "ag_frame", "ag_code", "tb_frame", "tb_next", "mro")
# torch's operators below its Python API, wherever they are read from.
TORCH_INTERNALS = ("ops", "library", "cpp_extension")
# What evaluates strings as code: annotations are strings under `from __future__ import annotations`.
STRING_EVALUATORS = ("get_type_hints", "ForwardRef")
# Attribute names refused whatever they are read from: each reaches what the rules above refuse by another way in.
OFF_LIMITS_ATTRIBUTES = {
    **dict.fromkeys(MODULE_ATTRIBUTES, "a module the imports may not name, reached as another module's attribute "
                                       "(dataclasses.sys is sys)"),
    **dict.fromkeys(("torch", "triton"), "torch and triton are used through your own import of them, not as another "
                                         "module's attribute"),
    **dict.fromkeys(TORCH_INTERNALS, "torch's operators below its Python API (torch.ops, torch.library, "
                                     "torch.utils.cpp_extension) are off limits"),
    **dict.fromkeys(FRAME_ATTRIBUTES, "frames, code objects and a class's method resolution order reach code that "
                                      "is not yours"),
    **dict.fromkeys(STRING_EVALUATORS, "it evaluates strings as code"),
}
# Builtins that run strings as code, reach the interpreter's namespaces or files, or wait for a person. Two are
# refused only where they can do harm: `locals()` called in a function holds that function's own variables (a check of
# its arguments reads them so), not the module's namespace and its `__builtins__`; `input` is also a common
# parameter's name, and a module that binds it calls its own.
REFUSED_BUILTINS = ("exec", "eval", "compile", "__import__", "open", "globals", "locals", "vars", "breakpoint", "input")
# Builtins that read or write an attribute named by a string: allowed with a constant name only.
ATTRIBUTE_BUILTINS = ("getattr", "setattr", "delattr", "hasattr")
# Dunder methods honest code calls through super(); the attribute machinery (__getattribute__, __setattr__ ...) is not
# among them, since through super() it reads or writes any attribute by a run-time name.
SUPER_DUNDERS = frozenset({"__init__", "__post_init__", "__new__", "__call__", "__repr__", "__str__", "__eq__",
                           "__hash__", "__len__", "__iter__", "__getitem__", "__setitem__", "__contains__",
                           "__enter__", "__exit__"})
# Dunders honest code reads (`type(x).__name__` in an error message) and binds (`__all__`, `__slots__`).
READABLE_DUNDERS = frozenset({"__name__"})
BINDABLE_DUNDERS = frozenset({"__all__", "__slots__"})

PRIVATE_RULE = "private and dunder attributes of modules and objects are off limits"
BUILTINS_RULE = (f"{', '.join(REFUSED_BUILTINS[:-1])} and input() are off limits (locals() is called only inside a "
                 "function)")
NAME_RULE = f"{', '.join(ATTRIBUTE_BUILTINS[:-1])} and hasattr take a constant name, never one computed at run time"
MODULE_VALUE_RULE = "modules are used through their attributes, never as values (assigned, passed, returned)"
PATCH_RULE = "what you import from outside your package, and the classes of objects, may not be changed"
SUPER_RULE = "super() takes no arguments, or a class defined in the same file and the instance"
STAR_RULE = "import names one by one from modules outside your package"
COMPILED_RULE = "a compiled module, which Python would import instead of your source: the package holds Python only"


@dataclass(frozen=True)
class Violation:
    file: str  # relative to the package's folder, e.g. "kernels/softmax.py"
    line: int | None
    rule: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.rule}" if self.line is not None else f"{self.file}: {self.rule}"


def imports_rule(family: str) -> str:
    return f"{family} problems may import only {', '.join(FAMILY_IMPORTS[family])} (and the package's own modules)"


# Every module some family may import: `from torch import distributed` imports one, `from torch import Tensor` does not.
KNOWN_MODULES = frozenset(module for allowed in FAMILY_IMPORTS.values() for module in allowed)


def is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__") and len(name) > 4


def shown(node: ast.AST) -> str:
    text = ast.unparse(node)
    return text if len(text) <= 60 else text[:57] + "..."


# --- where the package's modules are --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Package:
    name: str  # the name it is imported under
    folder: Path

    def owns(self, module: str) -> bool:
        return module == self.name or module.startswith(self.name + ".")

    def location(self, module: str) -> Path:
        """The folder or file stem a module of the package lives at (without a suffix)."""
        return self.folder.joinpath(*module.split(".")[1:])

    def candidates(self, module: str, suffix: str) -> list[Path]:
        """Where Python looks for `module` with files of `suffix`: a package's `__init__` before a module file of the
        same name (the top-level package is its folder's `__init__` alone)."""
        location = self.location(module)
        found = [location / f"__init__{suffix}"]
        if location != self.folder:
            found.append(location.with_name(location.name + suffix))
        return found

    def source(self, module: str) -> Path | None:
        """The file Python imports `module` from (None: a folder without `__init__.py`, or no such module)."""
        return next((path for path in self.candidates(module, ".py") if path.is_file()), None)

    def compiled(self, module: str) -> list[Path]:
        """Extension modules Python would import `module` from ahead of its source."""
        return [path for suffix in importlib.machinery.EXTENSION_SUFFIXES for path in self.candidates(module, suffix)
                if path.is_file()]

    def relative(self, path: Path) -> str:
        return path.relative_to(self.folder).as_posix()


def module_name(package: Package, path: Path) -> str:
    """The dotted name of the package's file at `path` (a package's `__init__.py` is the package)."""
    parts = path.relative_to(package.folder).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((package.name, *parts))


def relative_base(package: Package, path: Path, level: int) -> str | None:
    """The package that `from <level dots> import` in the file at `path` starts from (None: above the top)."""
    name = module_name(package, path)
    parts = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    if level - 1 >= len(parts):
        return None
    return ".".join(parts[: len(parts) - (level - 1)])


def with_parents(module: str) -> list[str]:
    """A module and the packages importing it imports first, outermost first."""
    parts = module.split(".")
    return [".".join(parts[:end]) for end in range(1, len(parts) + 1)]


# --- one file's rules -----------------------------------------------------------------------------------------------


class FileChecker(ast.NodeVisitor):
    """The violations of one file, and the package's modules it imports."""

    def __init__(self, package: Package, path: Path, family: str):
        self.package, self.path, self.family = package, path, family
        self.violations: list[Violation] = []
        self.imported_own: list[str] = []
        self.outside_names: dict[str, str] = {}  # a name bound by importing from outside the package: its path
        self.outside_modules: set[str] = set()  # those of them that are modules
        self.own_names: set[str] = set()  # names bound by importing from the package's own modules
        self.classes: set[str] = set()
        self.binds_input = False
        self.attribute_roots: set[int] = set()  # ids of Name nodes read as the base of an attribute
        self.called_names: set[int] = set()  # ids of Name nodes called as functions
        self.function_depth = 0

    def check(self, tree: ast.Module) -> None:
        self.learn_bindings(tree)
        self.visit(tree)

    def refuse(self, node: ast.AST | None, rule: str) -> None:
        line = getattr(node, "lineno", None)
        self.violations.append(Violation(self.package.relative(self.path), line, rule))

    # What the file binds, before any use is judged: an import may come after the function that uses it.
    def learn_bindings(self, tree: ast.Module) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    self.bind_import(alias.asname or alias.name.split(".")[0],
                                     alias.name if alias.asname else alias.name.split(".")[0])
            elif isinstance(node, ast.ImportFrom):
                base = self.absolute(node)
                for alias in node.names:
                    if base is not None and alias.name != "*":
                        self.bind_from_import(alias.asname or alias.name, base, alias.name)
            elif isinstance(node, ast.ClassDef):
                self.classes.add(node.name)
            elif isinstance(node, ast.Name) and node.id == "input" and isinstance(node.ctx, ast.Store):
                self.binds_input = True
            elif isinstance(node, ast.arg) and node.arg == "input":
                self.binds_input = True

    def bind_import(self, bound: str, module: str) -> None:
        if self.package.owns(module):
            self.own_names.add(bound)
        else:
            self.outside_names[bound] = module
            self.outside_modules.add(bound)

    def bind_from_import(self, bound: str, base: str, name: str) -> None:
        if self.package.owns(base):
            self.own_names.add(bound)
            return
        self.outside_names[bound] = f"{base}.{name}"
        if f"{base}.{name}" in KNOWN_MODULES:
            self.outside_modules.add(bound)

    def absolute(self, node: ast.ImportFrom) -> str | None:
        """The module a from-import reads from, with a relative one resolved (None: above the package's top)."""
        if node.level == 0:
            return node.module
        base = relative_base(self.package, self.path, node.level)
        if base is None:
            return None
        return f"{base}.{node.module}" if node.module else base

    # --- imports

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if self.package.owns(alias.name):
                self.imported_own.append(alias.name)
            else:
                self.check_outside_import(node, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = self.absolute(node)
        if base is None:
            return  # importing above the package's top fails before anything runs
        if self.package.owns(base):
            self.imported_own.append(base)
            self.imported_own += [f"{base}.{alias.name}" for alias in node.names if alias.name != "*"]
            return
        if not self.check_outside_import(node, base):
            return
        for alias in node.names:
            if alias.name == "*":
                self.refuse(node, f"imports * from {base}: {STAR_RULE}")
            else:
                self.check_imported_name(node, base, alias.name)

    def check_outside_import(self, node: ast.AST, module: str) -> bool:
        if module in FAMILY_IMPORTS[self.family]:
            return True
        self.refuse(node, f"imports {module}: {imports_rule(self.family)}")
        return False

    def check_imported_name(self, node: ast.AST, base: str, name: str) -> None:
        path = f"{base}.{name}"
        if name.startswith("_") and base != "__future__":
            self.refuse(node, f"imports {path}: {PRIVATE_RULE}")
        elif path in REFUSED_PATHS:
            self.refuse(node, f"imports {path}: {REFUSED_PATHS[path]}")
        elif name in OFF_LIMITS_ATTRIBUTES:
            self.refuse(node, f"imports {path}: {OFF_LIMITS_ATTRIBUTES[name]}")
        elif path in KNOWN_MODULES and path not in FAMILY_IMPORTS[self.family]:
            self.refuse(node, f"imports {path}: {imports_rule(self.family)}")

    # --- attributes

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name):
            self.attribute_roots.add(id(node.value))
        found_inside = len(self.violations)
        self.generic_visit(node)
        # One violation per expression: the innermost names the fault (torch._C, not torch._C._DisableTorchDispatch).
        if len(self.violations) == found_inside:
            self.check_attribute(node, node.value, node.attr, isinstance(node.ctx, (ast.Store, ast.Del)))

    def check_attribute(self, node: ast.AST, base: ast.expr, name: str, changes: bool) -> None:
        """The rules on reading (or, with `changes`, writing) attribute `name` of `base`."""
        used = f"{'changes' if changes else 'reads'} {shown(base)}.{name}"
        if is_dunder(name):
            if not (name in READABLE_DUNDERS or (is_super_call(base) and name in SUPER_DUNDERS)):
                self.refuse(node, f"{used}: {PRIVATE_RULE}")
        elif name.startswith("_") and not self.owns_private(base) and not self.family_private(base, name):
            self.refuse(node, f"{used}: {PRIVATE_RULE}")
        if name in OFF_LIMITS_ATTRIBUTES:
            self.refuse(node, f"{used}: {OFF_LIMITS_ATTRIBUTES[name]}")
        path = self.outside_path(base)
        if path is not None and f"{path}.{name}" in REFUSED_PATHS:
            self.refuse(node, f"uses {path}.{name}: {REFUSED_PATHS[f'{path}.{name}']}")
        if changes and (path is not None or is_type_call(base)):
            self.refuse(node, f"{used}: {PATCH_RULE}")

    def family_private(self, base: ast.expr, name: str) -> bool:
        return f"{self.outside_path(base)}.{name}" in FAMILY_PRIVATE_PATHS.get(self.family, ())

    def owns_private(self, base: ast.expr) -> bool:
        """A private attribute is the student's own on `self` or `cls`, or on what the package's modules hold."""
        while isinstance(base, ast.Attribute):
            base = base.value
        return isinstance(base, ast.Name) and (base.id in ("self", "cls") or base.id in self.own_names)

    def outside_path(self, node: ast.expr) -> str | None:
        """The dotted path an attribute chain names, when it starts at a name imported from outside the package."""
        if isinstance(node, ast.Name):
            return self.outside_names.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.outside_path(node.value)
            return f"{base}.{node.attr}" if base is not None else None
        return None

    def visit_MatchClass(self, node: ast.MatchClass) -> None:
        # `case C(name=...)` reads attribute `name` of the matched object.
        for name in node.kwd_attrs:
            self.check_attribute(node, node.cls, name, changes=False)
        self.generic_visit(node)

    # --- names and calls

    def visit_Name(self, node: ast.Name) -> None:
        name, loads = node.id, isinstance(node.ctx, ast.Load)
        if loads and name in REFUSED_BUILTINS and not self.harmless_builtin_use(node):
            self.refuse(node, f"uses {name}: {BUILTINS_RULE}")
        elif is_dunder(name) and name not in (READABLE_DUNDERS if loads else BINDABLE_DUNDERS):
            self.refuse(node, f"uses {name}: {PRIVATE_RULE}")
        elif loads and name in ATTRIBUTE_BUILTINS and id(node) not in self.called_names:
            self.refuse(node, f"uses {name} other than in a call: {NAME_RULE}")
        elif loads and name in self.outside_modules and id(node) not in self.attribute_roots:
            self.refuse(node, f"uses the module {self.outside_names[name]} as a value: {MODULE_VALUE_RULE}")

    def harmless_builtin_use(self, node: ast.Name) -> bool:
        if node.id == "locals":
            return self.function_depth > 0 and id(node) in self.called_names
        return node.id == "input" and self.binds_input

    def visit_Call(self, node: ast.Call) -> None:
        function = node.func
        if isinstance(function, ast.Name):
            self.called_names.add(id(function))
        if isinstance(function, ast.Name) and function.id in ATTRIBUTE_BUILTINS:
            self.check_attribute_builtin(node, function.id)
        elif isinstance(function, ast.Name) and function.id == "super" and node.args:
            if not (isinstance(node.args[0], ast.Name) and node.args[0].id in self.classes):
                self.refuse(node, f"calls {shown(node)}: {SUPER_RULE}")
        self.generic_visit(node)

    def check_attribute_builtin(self, node: ast.Call, builtin: str) -> None:
        """getattr(obj, "name") is obj.name: with a constant name, the attribute rules apply to it."""
        if len(node.args) < 2 or node.keywords:
            self.refuse(node, f"calls {builtin} without a constant name: {NAME_RULE}")
            return
        target, name = node.args[:2]
        if not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
            if builtin in COMPUTED_SETTERS and self.family in COMPUTED_SETTERS_FAMILIES:
                if self.outside_path(target) is not None or is_type_call(target):
                    self.refuse(node, f"calls {builtin} on {shown(target)}: {PATCH_RULE}")
                return
            self.refuse(node, f"calls {builtin} with the name {shown(name)}: {NAME_RULE}")
            return
        if isinstance(target, ast.Name):
            self.attribute_roots.add(id(target))
        self.check_attribute(node, target, name.value, changes=builtin in ("setattr", "delattr"))

    # --- annotations: typing's get_type_hints and functools.singledispatch evaluate the strings in them as code

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        annotations = [node.returns] + [arg.annotation for arg in all_arguments(node.args)]
        self.check_annotation_strings(annotation for annotation in annotations if annotation is not None)
        self.visit_function_body(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self.visit_function_body(node)

    def visit_function_body(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        self.function_depth += 1
        self.generic_visit(node)
        self.function_depth -= 1

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.check_annotation_strings([node.annotation])
        self.generic_visit(node)

    def check_annotation_strings(self, annotations) -> None:
        for annotation in annotations:
            for constant in ast.walk(annotation):
                if isinstance(constant, ast.Constant) and isinstance(constant.value, str):
                    self.check_expression_text(constant.value, constant.lineno)

    def check_expression_text(self, text: str, line: int) -> None:
        try:
            expression = ast.parse(text.strip(), mode="eval")
        except SyntaxError:
            return  # evaluating it raises before anything runs
        for parsed in ast.walk(expression):
            if hasattr(parsed, "lineno"):
                parsed.lineno = line
        self.visit(expression)


def all_arguments(arguments: ast.arguments) -> list[ast.arg]:
    extra = [arg for arg in (arguments.vararg, arguments.kwarg) if arg is not None]
    return [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, *extra]


def is_super_call(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def is_type_call(node: ast.expr) -> bool:
    """`type(x)`: the class of an object the grader may have made (torch.Tensor, whose methods the worker guards)."""
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type"


# --- a problem's modules, transitively --------------------------------------------------------------------------------


def parsed(path: Path) -> ast.Module | None:
    """The file's syntax tree, decoded from its bytes as Python decodes them (a coding line included), or None where
    it does not parse: importing it then fails before any of it runs."""
    try:
        return ast.parse(path.read_bytes(), filename=str(path))
    except (SyntaxError, ValueError, UnicodeDecodeError, OSError):
        return None


def checked(package: Package, module: str, family: str) -> FileChecker | None:
    """The checker that read `module`'s source (None where it has none, or it does not parse)."""
    path = package.source(module)
    tree = parsed(path) if path is not None else None
    if tree is None:
        return None
    checker = FileChecker(package, path, family)
    checker.check(tree)
    return checker


def violations(package_name: str, package_folder: Path, problem_id: str) -> list[Violation]:
    """Every violation of the policy in what importing `<package>.<problem_id>` runs: the packages on its way (their
    `__init__.py` files), the module, and the package's modules each of them imports, transitively, in that order."""
    package = Package(package_name, package_folder)
    family = problem_id.split(".")[0]
    found: list[Violation] = []
    seen: set[str] = set()
    waiting = with_parents(f"{package_name}.{problem_id}")
    while waiting:
        module = waiting.pop(0)
        if module in seen:
            continue
        seen.add(module)
        found += [Violation(package.relative(path), None, COMPILED_RULE) for path in package.compiled(module)]
        checker = checked(package, module, family)
        if checker is not None:
            found += checker.violations
            waiting += [parent for imported in checker.imported_own for parent in with_parents(imported)]
    return found


# --- the handout's text -----------------------------------------------------------------------------------------------


def describe(family: str) -> str:
    """The policy for one family's problems, as the grader's messages and tests state it."""
    return "\n".join((f"Before any of your code runs, the grader reads the source of each {family} problem's module, "
                      f"{READ_SCOPE}", f"- Imports: {imports_text(family)}", *(f"- {rule}" for rule in rules_text())))


READ_SCOPE = ("of every module of your package it imports, and of the package's `__init__.py` files. A file that "
              "breaks one of these rules fails every test of its problem, naming the file, the line and the rule.")


def imports_text(family: str) -> str:
    return (f"only {', '.join(f'`{module}`' for module in FAMILY_IMPORTS[family])}, and your package's own modules "
            "(relative imports, or absolute ones under your package's name).")


def rules_text() -> list[str]:
    """The rules every family shares, each family's exceptions named where they apply (the handout prints these
    once, beside a table of each family's imports)."""
    refused_paths = "; ".join(f"`{path}` ({why})" for path, why in REFUSED_PATHS.items())
    introspection = ", ".join(f"`{name}`" for name in FRAME_ATTRIBUTES)
    attribute_builtins = ", ".join(f"`{name}`" for name in ATTRIBUTE_BUILTINS[:-1])
    setters = " and ".join(f"`{name}`" for name in COMPUTED_SETTERS)
    setter_families = " and ".join(COMPUTED_SETTERS_FAMILIES)
    private_paths = "; ".join(f"in the {family} problems {', '.join(f'`{path}`' for path in paths)}"
                              for family, paths in FAMILY_PRIVATE_PATHS.items())
    return [
        f"No other module: in particular not {', '.join(f'`{module}`' for module in NAMED_REFUSED_MODULES)}, in any "
        "family, nor the same reached as another module's attribute (`dataclasses.sys`, `torch.nn.functional.np`; "
        "torch and triton too, which you use through your own import of them). Import names one by one (no "
        "`import *`) from outside your package.",
        "No private or dunder attributes of modules and objects: nothing starting with `_` read from a module or an "
        "object (`torch._C`, `torch.utils._pytree`, `f.__globals__`, `x.__dict__`, `cls.__subclasses__`, "
        "`__builtins__`), with these exceptions: your own private state on `self` and `cls` (`self._cache`), your own "
        f"modules' private names (`from .router import _helper`), `type(x).__name__`, and {private_paths}. Dunder "
        "methods are yours to define (`__init__`, `__post_init__`) and to call through `super()` "
        "(`super().__init__()`).",
        f"Off limits in torch and triton: {refused_paths}; `torch.ops`, `torch.library`, "
        "`torch.utils.cpp_extension` (operators below torch's Python API).",
        f"No frames, code objects or method resolution orders ({introspection}); no `typing.get_type_hints` or "
        "`typing.ForwardRef` (they evaluate strings as code, and so does every string in an annotation, which is "
        "checked as code).",
        f"Builtins: never {', '.join(f'`{name}`' for name in REFUSED_BUILTINS[:-1])}, nor `input()` (a parameter may "
        "be called `input`), except `locals()` called inside a function, where it holds that function's own "
        f"variables (`check_arguments(locals())`). {attribute_builtins} and `hasattr` only when called with a "
        "constant name (`getattr(config, \"eps\", 1e-6)`), to which the rules on attributes apply; in the "
        f"{setter_families} problems {setters} may also take a name computed at run time (parameter surgery by name), "
        "on your own objects. `super()` with arguments only as `super(YourClass, self)`.",
        "Modules are used through their attributes (`torch.empty`, `tl.load`): never assigned, passed or returned as "
        "values. Nothing imported from outside your package is changed (no `torch.Tensor.x = ...`), nor the class of "
        "an object through `type(x)`.",
        "Python source only: no compiled module (`.so`) where Python would import one of your modules from.",
    ]
