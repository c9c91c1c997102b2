"""How ``tandem serve`` reads ``vllm serve`` command lines: option names spelled with
underscores, dotted keys of JSON-valued options (``LaunchArgumentParser``), and the flags that
describe what Tandem always does, accepted and logged once (``flag_notes``), or, where Tandem
cannot honour them, refused by name (``check_flags``): a parameter is honoured or refused, never
quietly changed."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

# Options whose value is a JSON object, and so also take dotted keys (``--OPTION.key value``).
JSON_OPTIONS = ("--speculative-config", "--default-chat-template-kwargs", "--eplb-config")
EXECUTOR_BACKENDS = ("mp", "uni", "ray", "external_launcher")


def _json_or_text(text: str) -> Any:
    """A dotted key's value: JSON when it parses (3, true, null, [1, 2], "x"), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


class LaunchArgumentParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` that also reads the spellings of ``vllm serve`` lines:

    - ``--max_model_len`` for ``--max-model-len`` (an underscore spelling of a known option);
    - dotted keys of the ``JSON_OPTIONS`` it has: ``--speculative-config.method mtp
      --speculative-config.num_speculative_tokens 3`` equals ``--speculative-config
      '{"method": "mtp", "num_speculative_tokens": 3}'``; ``--OPTION.a.b v`` nests. A value is
      JSON when it parses, else a string. Dotted keys merge into the JSON form when both are
      given; a key set twice to different values, or keys added to a non-object, is an error.
    """

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        argv, dotted = self._expand(list(sys.argv[1:] if args is None else args))
        ns, rest = super().parse_known_args(argv, namespace)
        for option, keys in dotted.items():
            self._merge_dotted(ns, option, keys)
        return ns, rest

    def _spelling(self, name: str) -> str:
        """``name``, or its dashed spelling when only that is an option here."""
        dashed = "--" + name[2:].replace("_", "-")
        known = self._option_string_actions
        return dashed if name not in known and dashed in known else name

    def _expand(self, args: list[str]) -> tuple[list[str], dict[str, list[tuple[str, Any]]]]:
        out: list[str] = []
        dotted: dict[str, list[tuple[str, Any]]] = {}
        i = 0
        while i < len(args):
            token = args[i]
            i += 1
            if token == "--":
                out += args[i - 1 :]
                break
            if not token.startswith("--"):
                out.append(token)
                continue
            key, eq, value = token.partition("=")
            name, dot, path = key.partition(".")
            name = self._spelling(name)
            if not dot or name not in JSON_OPTIONS or name not in self._option_string_actions:
                out.append(name + dot + path + eq + value)
                continue
            if not eq:
                if i >= len(args) or args[i].startswith("--"):
                    self.error(f"{key} needs a value (e.g. {key} 3)")
                value, i = args[i], i + 1
            if not path or "" in path.split(".") or path.endswith("+"):
                self.error(
                    f"{key}: expected {name}.KEY VALUE (KEY a name, or a.b for a nested one; a "
                    f"list goes in as JSON: {name}.KEY '[1, 2]')"
                )
            dotted.setdefault(name, []).append((path, _json_or_text(value)))
        return out, dotted

    def _merge_dotted(
        self, ns: argparse.Namespace, option: str, keys: list[tuple[str, Any]]
    ) -> None:
        action = self._option_string_actions[option]
        given = getattr(ns, action.dest, None)
        if isinstance(given, str) and given.strip().lower() in ("none", "null"):
            self.error(f"{option} {given} turns it off: dotted keys cannot add to it; drop one")
        if isinstance(given, str):
            try:
                given = json.loads(given)
            except ValueError as e:
                self.error(f"{option} is not valid JSON: {e}")
        if given is None:
            given = {}
        if not isinstance(given, dict):
            self.error(f"{option} {json.dumps(given)} is not a JSON object: dotted keys need one")
        merged: dict[str, Any] = json.loads(json.dumps(given))  # a copy to merge into
        for path, value in keys:
            *parents, leaf = path.split(".")
            node = merged
            for i, part in enumerate(parents):
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    self.error(f"{option}.{'.'.join(parents[: i + 1])} is not an object")
            if leaf in node and node[leaf] != value:
                self.error(
                    f"{option}.{path} is given twice: {json.dumps(node[leaf])} and "
                    f"{json.dumps(value)}; keep one"
                )
            node[leaf] = value
        text = json.dumps(merged)
        setattr(ns, action.dest, text if action.type is None else action.type(text))


def check_flags(ns: argparse.Namespace) -> None:
    """Refuse the other servers' flags Tandem cannot honour, naming what to change."""
    if ns.enable_chunked_prefill is False:
        raise ValueError(
            "--no-enable-chunked-prefill cannot be honoured: Tandem always prefills long prompts "
            "in chunks of --max-num-batched-tokens; drop the flag"
        )
    if ns.swap_space is not None and ns.swap_space < 0:
        raise ValueError(f"--swap-space must be >= 0 GiB, got {ns.swap_space}")
    backend = ns.distributed_executor_backend
    if backend == "ray":
        raise ValueError(
            "--distributed-executor-backend ray is not supported: Tandem starts its ranks as "
            "processes itself (mp), across nodes with --nnodes/--node-rank, or under torchrun"
        )
    if backend == "uni" and (ns.tensor_parallel_size != 1 or ns.data_parallel_size != 1):
        raise ValueError(
            "--distributed-executor-backend uni runs the model in one process: it needs "
            f"--tensor-parallel-size 1 and --data-parallel-size 1, got {ns.tensor_parallel_size} "
            f"and {ns.data_parallel_size} (use mp)"
        )
    if backend == "external_launcher" and not ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        raise ValueError(
            "--distributed-executor-backend external_launcher: start one `tandem serve` per rank "
            "with torchrun or srun (RANK and WORLD_SIZE set); Tandem detects the launcher itself"
        )


def flag_notes(ns: argparse.Namespace) -> list[str]:
    """One log line for each accepted flag that describes what Tandem always does."""
    notes = []
    if ns.trust_remote_code:
        notes.append(
            "--trust-remote-code: no remote code is run; Tandem serves the architectures it "
            "implements and refuses others by name"
        )
    if ns.enable_chunked_prefill:
        notes.append(
            "--enable-chunked-prefill: always on (long prompts are prefilled in chunks of "
            "--max-num-batched-tokens)"
        )
    if ns.enable_auto_tool_choice:
        notes.append(
            "--enable-auto-tool-choice: always on (tool calls are parsed whenever a request has "
            "tools)"
        )
    if ns.disable_log_requests:
        notes.append("--disable-log-requests: request contents are never logged")
    if ns.swap_space is not None:
        notes.append(
            f"--swap-space {ns.swap_space:g}: not used (a preempted request is recomputed, "
            "never swapped to CPU memory)"
        )
    if ns.distributed_executor_backend is not None:
        notes.append(
            f"--distributed-executor-backend {ns.distributed_executor_backend}: accepted (Tandem "
            "starts and places its ranks itself)"
        )
    return notes
