"""The tests' type-checking import hook (tests/conftest.py): module-level functions,
methods and classes of `cpkv_jax` and `serving` are checked while tests run; functions
and classes defined inside a function body are left unchecked (jaxtyping would build
two beartype checkers each time such a def executes)."""

import ast

import jaxtyping
import jaxtyping._import_hook as hook
import pytest

from serving.engine.wait_queue import WaitQueue

SOURCE = """
def outer(x: int) -> int:
    def inner(y: int) -> int:
        return y

    class Local:
        pass

    async def stream(z: int) -> None:
        def deeper() -> None:
            pass

    return inner(x)


class Module:
    def method(self, x: int) -> int:
        def helper() -> int:
            return x

        return helper()


async def handler() -> None:
    def callback() -> None:
        pass
"""


def _checked_defs(source: str) -> set[str]:
    tree = ast.parse(source)
    hook.JaxtypingTransformer(typechecker=hook.Typechecker(None)).visit(tree)
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        and any("jaxtyped" in ast.unparse(d) for d in node.decorator_list)
    }


def test_only_defs_outside_function_bodies_are_decorated() -> None:
    assert _checked_defs(SOURCE) == {"outer", "Module", "method"}


def test_a_module_method_is_checked_at_run_time() -> None:
    queue: WaitQueue[int] = WaitQueue(2, what="decode")
    with pytest.raises(jaxtyping.TypeCheckError, match="rid"):
        queue.push(7, 1)  # type: ignore[arg-type]  # rid must be a str
    queue.push("r0", 1)
    assert len(queue) == 1
