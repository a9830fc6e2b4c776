"""The JSON schema of ``report.json`` (draft 2020-12), for readers that check a report before using it.

    import jsonschema
    jsonschema.validate(json.load(open("report.json")), REPORT_SCHEMA)
"""
from __future__ import annotations

_NUM = {"type": "number"}
_OPT_NUM = {"type": ["number", "null"]}
_POS = {"type": "number", "exclusiveMinimum": 0}  # a rate, a time or a ratio of two
_OPT_POS = {"type": ["number", "null"], "exclusiveMinimum": 0}
_INT = {"type": "integer", "minimum": 0}
_POINT = {  # the point's identity: what was asked for
    "kind": {"enum": ["engine", "hf_generate"]},
    "policy": {"type": "string"},
    "budget": {"type": ["integer", "null"]},
    "batch_request": {"anyOf": [{"type": "integer", "minimum": 1}, {"const": "max"}]},
    "length": {"type": "integer", "minimum": 1},
}
MEASUREMENT = {
    "type": "object",
    "required": list(_POINT) + ["batch", "capacity", "kv_bytes_per_seq", "largest_batch", "run_tokens",
                                "extrapolated", "tok_s", "steady_step_ms", "floor_step_ms", "step_over_floor",
                                "mean_live_tokens", "events", "x_full", "x_hf", "measure_s"],
    "properties": {
        **_POINT,
        "batch": {"type": "integer", "minimum": 1}, "capacity": {"type": "integer", "minimum": 1},
        "kv_bytes_per_seq": {"type": "integer", "minimum": 1}, "largest_batch": {"type": "integer", "minimum": 1},
        "run_tokens": {"type": "integer", "minimum": 1}, "extrapolated": {"type": "boolean"},
        "tok_s": {"type": "number", "exclusiveMinimum": 0}, "steady_step_ms": {"type": "number", "exclusiveMinimum": 0},
        "floor_step_ms": {"type": "number", "exclusiveMinimum": 0}, "step_over_floor": _POS,
        "mean_live_tokens": {"type": "number", "minimum": 0}, "live_tokens_end": _NUM, "kernel_live_tokens": _NUM,
        "events": _INT,
        "x_full": _OPT_POS, "x_hf": _OPT_POS, "measure_s": {"type": "number", "minimum": 0},
        "kernels_per_step": {"type": ["integer", "null"], "minimum": 0},
        "kernels_per_layer": {"type": ["integer", "null"], "minimum": 0},
        "kernel_us_per_step": _NUM, "kernel_us_outside_layers": _NUM,
        "top_kernels": {"type": "array", "items": {"type": "array", "minItems": 3, "maxItems": 3}},
        "e2e_tok_s": _NUM, "decode_tok_s": _NUM, "policy_share": _NUM, "event_ms_median": _NUM,
        "step_curve": {"type": "array", "minItems": 1,
                       "items": {"type": "array", "items": _NUM, "minItems": 3, "maxItems": 3}},
    },
}
ENVIRONMENT = {
    "type": "object",
    "required": ["device", "device_name", "python", "torch", "transformers", "kvroll", "date", "command",
                 "weight_bytes", "kv_bytes_per_token", "copy_bandwidth"],
    "properties": {"device": {"enum": ["cpu", "cuda"]}, "device_name": {"type": "string"},
                   "date": {"type": "string"}, "command": {"type": "string"},
                   "weight_bytes": {"type": "integer", "minimum": 1},
                   "kv_bytes_per_token": {"type": "integer", "minimum": 1},
                   "copy_bandwidth": {"type": "number", "exclusiveMinimum": 0}},
}
REPORT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "kvroll bench report",
    "type": "object",
    "required": ["schema_version", "status", "environment", "config", "measurements", "errors", "seconds"],
    "properties": {
        "schema_version": {"const": 1},
        "status": {"enum": ["running", "complete", "interrupted"]},
        "environment": ENVIRONMENT,
        "config": {"type": "object", "required": ["policies", "budgets", "batch_sizes", "output_lengths"]},
        "measurements": {"type": "array", "items": MEASUREMENT},
        "errors": {"type": "array", "items": {"type": "object", "required": list(_POINT) + ["error"],
                                              "properties": {**_POINT, "error": {"type": "string", "minLength": 1}}}},
        "seconds": {"type": "number", "minimum": 0},
        "plots": {"type": "object", "additionalProperties": {"type": "string", "pattern": "\\.png$"}},
    },
}
