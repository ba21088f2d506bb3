"""The part of CEL (the Common Expression Language of `x-kubernetes-validations`) that tgp's CRDs
use, evaluated as the API server does, so the emulator refuses at apply what a real cluster
refuses (422, the rule's message).

Supported: string literals ('...' or "..."), integers, `true`/`false`, `self` and a macro's
variable, field access (`self.metadata.name`), `<=`, `<`, `>=`, `>`,
`!`, `&&`, `||`, `==`, `!=`, parentheses, the string methods `startsWith`, `endsWith`,
`contains`, `matches` (RE2, unanchored, as in CEL) and `size()`, `size()` of a list or map, the
macros `all(x, e)` and `exists(x, e)` over a list's items or a map's keys, and `has(x.f)`
(whether a field is present: the API server drops absent fields and nulls that are not nullable). A rule outside that subset raises
`Unsupported` when compiled; the schema validator then leaves it unevaluated (as before CEL
rules were evaluated at all), which tests/test_crds.py checks never happens to tgp's own rules.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from functools import lru_cache
from typing import Any

__all__ = ["Unsupported", "compile_rule", "go_regexp"]

Env = dict[str, Any]
Expr = Callable[[Env], Any]

_TOKEN = re.compile(
    r"""\s*(?:(?P<str>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")|(?P<op>&&|\|\||==|!=|<=|>=|[<>!().,])|(?P<int>[0-9]+)|(?P<ident>[A-Za-z_][A-Za-z0-9_]*))"""
)
_STRING_METHODS: dict[str, Callable[[str, str], bool]] = {
    "startsWith": str.startswith,
    "endsWith": str.endswith,
    "contains": lambda s, part: part in s,
    "matches": lambda s, pattern: go_regexp(pattern).search(s) is not None,
}


_COMPARISONS: dict[str, Callable[[Any, Any], bool]] = {
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    "<=": lambda a, b: a <= b,
    ">=": lambda a, b: a >= b,
    "<": lambda a, b: a < b,
    ">": lambda a, b: a > b,
}


class Unsupported(Exception):
    """A rule outside the subset this module evaluates."""


def _tokens(text: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        match = _TOKEN.match(text, pos)
        if match is None:
            raise Unsupported(f"cannot read {text[pos:pos + 20]!r}")
        kind = match.lastgroup or ""
        out.append((kind, match.group(kind)))
        pos = match.end()
    return out


class _Parser:
    def __init__(self, text: str) -> None:
        self.tokens = _tokens(text)
        self.pos = 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, value: str | None = None) -> tuple[str, str]:
        token = self.peek()
        if token is None or (value is not None and token[1] != value):
            raise Unsupported(f"expected {value or 'more'}, found {token}")
        self.pos += 1
        return token

    def parse(self) -> Expr:
        expr = self.disjunction()
        if self.peek() is not None:
            raise Unsupported(f"unexpected {self.peek()}")
        return expr

    def disjunction(self) -> Expr:
        left = self.conjunction()
        while self.peek() == ("op", "||"):
            self.take()
            right = self.conjunction()
            left = (lambda a, b: lambda env: bool(a(env)) or bool(b(env)))(left, right)
        return left

    def conjunction(self) -> Expr:
        left = self.unary()
        while self.peek() == ("op", "&&"):
            self.take()
            right = self.unary()
            left = (lambda a, b: lambda env: bool(a(env)) and bool(b(env)))(left, right)
        return left

    def unary(self) -> Expr:
        if self.peek() == ("op", "!"):
            self.take()
            inner = self.unary()
            return lambda env: not inner(env)
        return self.comparison()

    def comparison(self) -> Expr:
        left = self.postfix()
        token = self.peek()
        if token is not None and token[0] == "op" and token[1] in _COMPARISONS:
            self.take()
            right = self.postfix()
            compare = _COMPARISONS[token[1]]
            return lambda env: compare(left(env), right(env))
        return left

    def postfix(self) -> Expr:
        target = self.primary()
        while self.peek() == ("op", "."):
            self.take()
            _, name = self.take()
            if self.peek() == ("op", "("):
                self.take("(")
                target = self.call(target, name)
            else:
                target = (lambda t, n: lambda env: _field(t(env), n))(target, name)
        return target

    def call(self, target: Expr, method: str) -> Expr:
        if method in ("all", "exists"):
            kind, var = self.take()
            if kind != "ident":
                raise Unsupported(f"{method} needs a variable")
            self.take(",")
            body = self.disjunction()
            self.take(")")
            quantifier = all if method == "all" else any

            def macro(env: Env) -> bool:
                items = target(env)
                return quantifier(bool(body({**env, var: item})) for item in items)

            return macro
        if method == "size":
            self.take(")")
            return lambda env: len(target(env))
        if method in _STRING_METHODS:
            argument = self.disjunction()
            self.take(")")
            test = _STRING_METHODS[method]
            return lambda env: test(target(env), argument(env))
        raise Unsupported(f"method {method}")

    def primary(self) -> Expr:
        kind, value = self.take()
        if kind == "int":
            number = int(value)
            return lambda env: number
        if kind == "str":
            literal = bytes(value[1:-1], "utf-8").decode("unicode_escape")
            return lambda env: literal
        if (kind, value) == ("op", "("):
            inner = self.disjunction()
            self.take(")")
            return inner
        if kind == "ident" and value == "has" and self.peek() == ("op", "("):
            return self.has()
        if kind == "ident":
            if value in ("true", "false"):
                return lambda env: value == "true"
            return lambda env: env[value] if value in env else _unknown(value)
        raise Unsupported(f"unexpected {value!r}")


    def has(self) -> Expr:
        """`has(e.f)`: e evaluated, then whether it holds the key f."""
        self.take("(")
        target = self.primary()
        names = []
        while self.peek() == ("op", "."):
            self.take()
            names.append(self.take()[1])
        self.take(")")
        if not names:
            raise Unsupported("has() needs a field selection")
        *path, last = names
        for name in path:
            target = (lambda t, n: lambda env: _field(t(env), n))(target, name)
        return lambda env: _present(target(env), last)


def _present(value: Any, name: str) -> bool:
    if not isinstance(value, Mapping):
        raise Unsupported(f"has() of a field of {type(value).__name__}")
    return name in value


def _field(value: Any, name: str) -> Any:
    if not isinstance(value, Mapping) or name not in value:
        raise Unsupported(f"no such key: {name}")  # CEL's runtime error; the rule is not decided here
    return value[name]


def _unknown(name: str) -> Any:
    raise Unsupported(f"unknown variable {name}")


@lru_cache(maxsize=256)
def compile_rule(rule: str) -> Callable[[Any], bool]:
    """`rule` as a function of `self` (the value the rule sits on): True when it holds.
    Raises Unsupported for a rule outside the subset."""
    expr = _Parser(rule).parse()

    def holds(value: Any) -> bool:
        return bool(expr({"self": value}))  # a map's macros and size() see its keys, as in CEL

    return holds


_GO_PATTERNS: dict[str, re.Pattern[str]] = {}


def go_regexp(pattern: str) -> re.Pattern[str]:
    """A schema pattern with Go's RE2 meaning of `$`: the very end of the text. Python's `$`
    also matches before a final newline, so `^[a-z]+$` would take "abc\n", which the API
    server refuses (the difference an injected newline slips through)."""
    compiled = _GO_PATTERNS.get(pattern)
    if compiled is None:
        out, i, n = [], 0, len(pattern)
        while i < n:
            char = pattern[i]
            if char == "\\" and i + 1 < n:
                out.append("\\Z" if pattern[i + 1] == "z" else pattern[i : i + 2])  # RE2 \z: end of text
                i += 2
            elif char == "[":  # a character class is copied as is ($ is literal in it)
                j = i + 1
                j += pattern[j : j + 1] == "^"
                j += pattern[j : j + 1] == "]"
                while j < n and pattern[j] != "]":
                    j += 2 if pattern[j] == "\\" else 1
                out.append(pattern[i : j + 1])
                i = j + 1
            else:
                out.append("\\Z" if char == "$" else char)
                i += 1
        compiled = _GO_PATTERNS[pattern] = re.compile("".join(out))
    return compiled
