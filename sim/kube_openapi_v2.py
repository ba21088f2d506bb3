"""`/openapi/v2` of the embedded Kubernetes API: the OpenAPI v3 documents of kube_openapi as one
Swagger 2.0 document, in JSON or in the protobuf encoding kubectl asks for.

kubectl reads v2 only as protobuf (`Accept: application/com.github.proto-openapi.spec.v2@v1.0+
protobuf`, the `openapi.v2.Document` message of github.com/google/gnostic): for `kubectl explain
--output plaintext-openapiv2`, for client-side validation against a server without
`fieldValidation`, and to ask whether a kind takes a strategic merge patch (the PATCH
operation's `consumes`; here it does not, so kubectl keeps using its compiled-in patch metadata).
The encoder below writes the few messages a Swagger document of this shape needs, with the
field numbers of gnostic's openapiv2/OpenAPIv2.proto; vendor extensions, defaults and enum
values go as `Any.yaml` (JSON text, which is YAML), as kube-openapi writes them.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from typing import Any

from sim.kube_openapi import REF_V3

Obj = dict[str, Any]

PROTOBUF = "application/com.github.proto-openapi.spec.v2@v1.0+protobuf"
_REF_V2 = "#/definitions/"


def wants_protobuf(accept: str) -> bool:
    return any(media.split(";")[0].strip() == PROTOBUF for media in accept.split(","))


# --- Swagger 2.0 as JSON -------------------------------------------------------------------


def _to_v2(value: Any) -> Any:
    """A v3 schema in Swagger 2.0 form: `#/definitions/` references, `allOf: [ref]` unwrapped."""
    if isinstance(value, Mapping):
        if set(value) <= {"allOf", "description", "default"} and len(value.get("allOf") or []) == 1:
            return {**_to_v2(value["allOf"][0]), **{k: v for k, v in value.items() if k != "allOf"}}
        out = {}
        for key, item in value.items():
            if key == "$ref" and isinstance(item, str) and item.startswith(REF_V3):
                out[key] = _REF_V2 + item[len(REF_V3):]
            elif key == "anyOf":
                continue  # int-or-string: Swagger 2.0 has no anyOf (x-kubernetes-int-or-string stays)
            else:
                out[key] = _to_v2(item)
        return out
    if isinstance(value, list):
        return [_to_v2(item) for item in value]
    return value


def _parameter(parameter: Mapping[str, Any]) -> Obj:
    converted = {k: v for k, v in parameter.items() if k != "schema"}
    converted["type"] = "string"
    return converted


def swagger(documents: Iterable[Obj]) -> Obj:
    """The definitions and operations of all group-version documents as Swagger 2.0."""
    definitions: dict[str, Obj] = {}
    paths: dict[str, Obj] = {}
    for document in documents:
        for name, schema in document["components"]["schemas"].items():
            definitions[name] = _to_v2(schema)
        for path, item in document["paths"].items():
            converted: Obj = {}
            for method, operation in item.items():
                if method == "parameters":
                    converted[method] = [_parameter(p) for p in operation]
                    continue
                operation = dict(operation)
                body = operation.pop("requestBody", None)
                parameters = [_parameter(p) for p in operation.pop("parameters", [])]
                if body is not None:
                    content = body["content"]
                    operation["consumes"] = list(content)
                    schema = next(iter(content.values()))["schema"]
                    parameters.insert(0, {"name": "body", "in": "body", "required": True, "schema": _to_v2(schema)})
                responses = {}
                for code, response in operation.pop("responses", {}).items():
                    schema = next(iter(response.get("content", {}).values()), {}).get("schema")
                    responses[code] = {"description": response.get("description", "")}
                    if schema:
                        responses[code]["schema"] = _to_v2(schema)
                operation.update(parameters=parameters, responses=responses, produces=["application/json"])
                converted[method] = operation
            paths[path] = converted
    return {
        "swagger": "2.0",
        "info": {"title": "Kubernetes (tgp emulator)", "version": "unversioned"},
        "paths": dict(sorted(paths.items())),
        "definitions": dict(sorted(definitions.items())),
    }


# --- protobuf wire format ------------------------------------------------------------------


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64: two's complement, ten bytes
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _bytes(field: int, data: bytes) -> bytes:
    return _key(field, 2) + _varint(len(data)) + data


def _string(field: int, value: Any) -> bytes:
    return _bytes(field, str(value).encode()) if value not in (None, "") else b""


def _strings(field: int, values: Iterable[Any]) -> bytes:
    return b"".join(_bytes(field, str(v).encode()) for v in values)


def _bool(field: int, value: Any, *, always: bool = False) -> bytes:
    return _key(field, 0) + _varint(1 if value else 0) if value or always else b""


def _int(field: int, value: Any) -> bytes:
    return _key(field, 0) + _varint(int(value)) if value else b""


def _double(field: int, value: Any) -> bytes:
    return _key(field, 1) + struct.pack("<d", float(value)) if value else b""


def _any(value: Any) -> bytes:
    """openapi.v2.Any with the value as YAML (JSON text)."""
    return _string(2, json.dumps(value))


def _named_any(field: int, name: str, value: Any) -> bytes:
    return _bytes(field, _string(1, name) + _bytes(2, _any(value)))


def _extensions(field: int, obj: Mapping[str, Any]) -> bytes:
    return b"".join(_named_any(field, k, v) for k, v in obj.items() if k.startswith("x-"))


# --- openapi.v2 messages -------------------------------------------------------------------


def _schema(schema: Mapping[str, Any]) -> bytes:
    """openapi.v2.Schema."""
    out = [
        _string(1, schema.get("$ref")), _string(2, schema.get("format")), _string(3, schema.get("title")),
        _string(4, schema.get("description")),
    ]
    if "default" in schema:
        out.append(_bytes(5, _any(schema["default"])))
    out += [
        _double(6, schema.get("multipleOf")), _double(7, schema.get("maximum")),
        _bool(8, schema.get("exclusiveMaximum")), _double(9, schema.get("minimum")),
        _bool(10, schema.get("exclusiveMinimum")), _int(11, schema.get("maxLength")),
        _int(12, schema.get("minLength")), _string(13, schema.get("pattern")), _int(14, schema.get("maxItems")),
        _int(15, schema.get("minItems")), _bool(16, schema.get("uniqueItems")),
        _int(17, schema.get("maxProperties")), _int(18, schema.get("minProperties")),
        _strings(19, schema.get("required") or []),
        b"".join(_bytes(20, _any(v)) for v in schema.get("enum") or []),
    ]
    extra = schema.get("additionalProperties")
    if isinstance(extra, Mapping):
        out.append(_bytes(21, _bytes(1, _schema(extra))))
    elif isinstance(extra, bool):
        out.append(_bytes(21, _bool(2, extra, always=True)))
    if schema.get("type"):
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        out.append(_bytes(22, _strings(1, types)))
    items = schema.get("items")
    if items is not None:
        out.append(_bytes(23, b"".join(_bytes(1, _schema(i)) for i in (items if isinstance(items, list) else [items]))))
    out += [_bytes(24, _schema(s)) for s in schema.get("allOf") or []]
    if "properties" in schema:
        out.append(_bytes(25, b"".join(
            _bytes(1, _string(1, name) + _bytes(2, _schema(sub))) for name, sub in schema["properties"].items()
        )))
    out.append(_bool(27, schema.get("readOnly")))
    out.append(_extensions(31, schema))
    return b"".join(out)


def _parameters_item(parameter: Mapping[str, Any]) -> bytes:
    """openapi.v2.ParametersItem (a body, query or path parameter)."""
    where = parameter.get("in")
    if where == "body":
        body = (_string(1, parameter.get("description")) + _string(2, parameter.get("name")) + _string(3, "body")
                + _bool(4, parameter.get("required")) + _bytes(5, _schema(parameter.get("schema") or {})))
        inner = _bytes(1, body)
    else:
        common = (_bool(1, parameter.get("required")) + _string(2, where) + _string(3, parameter.get("description"))
                  + _string(4, parameter.get("name")))
        if where == "path":
            inner = _bytes(2, _bytes(4, common + _string(5, parameter.get("type"))))
        else:  # query
            inner = _bytes(2, _bytes(3, common + _string(6, parameter.get("type"))
                                     + _bool(20, parameter.get("uniqueItems"))))
    return _bytes(1, inner)


def _operation(operation: Mapping[str, Any]) -> bytes:
    responses = b"".join(
        _bytes(1, _string(1, code) + _bytes(2, _bytes(1, _string(1, response.get("description"))
                                                       + (_bytes(2, _bytes(1, _schema(response["schema"])))
                                                          if response.get("schema") else b""))))
        for code, response in (operation.get("responses") or {}).items()
    )
    return b"".join([
        _string(3, operation.get("description")), _string(5, operation.get("operationId")),
        _strings(6, operation.get("produces") or []), _strings(7, operation.get("consumes") or []),
        b"".join(_bytes(8, _parameters_item(p)) for p in operation.get("parameters") or []),
        _bytes(9, responses), _extensions(13, operation),
    ])


_METHODS = {"get": 2, "put": 3, "post": 4, "delete": 5, "options": 6, "head": 7, "patch": 8}


def protobuf(document: Mapping[str, Any]) -> bytes:
    """The Swagger 2.0 `document` as an openapi.v2.Document message."""
    paths = b""
    for path, item in document.get("paths", {}).items():
        encoded = b"".join(_bytes(_METHODS[m], _operation(op)) for m, op in item.items() if m in _METHODS)
        encoded += b"".join(_bytes(9, _parameters_item(p)) for p in item.get("parameters") or [])
        paths += _bytes(2, _string(1, path) + _bytes(2, encoded))
    definitions = b"".join(
        _bytes(1, _string(1, name) + _bytes(2, _schema(schema)))
        for name, schema in document.get("definitions", {}).items()
    )
    info = document.get("info") or {}
    return b"".join([
        _string(1, document.get("swagger", "2.0")),
        _bytes(2, _string(1, info.get("title")) + _string(2, info.get("version"))),
        _bytes(8, paths), _bytes(9, definitions),
    ])
