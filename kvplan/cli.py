"""The `kvplan` command: offline planning, and the server entry point.

Exit codes: 0 ok; 1 internal / unavailable; 2 bad input (unreadable file, bad
YAML/JSON, INVALID_ARGUMENT); 3 FAILED_PRECONDITION; 4 RESOURCE_EXHAUSTED;
5 NOT_FOUND; 6 UNAUTHENTICATED / PERMISSION_DENIED (credentials). `kvplan health`:
0 when the service is SERVING, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from kvplan.v1 import plan_pb2

EXIT_CODES = {
    "INVALID_ARGUMENT": 2,
    "FAILED_PRECONDITION": 3,
    "RESOURCE_EXHAUSTED": 4,
    "NOT_FOUND": 5,
    "UNAUTHENTICATED": 6,
    "PERMISSION_DENIED": 6,
}
GIB = 1 << 30


class InputError(Exception):
    """A request file that cannot be read or parsed."""


def load_request(path: str) -> plan_pb2.PlanRequest:
    """A PlanRequest from YAML or JSON in the proto's JSON mapping."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise InputError(f"{path}: cannot read: {error.strerror}") from error
    data: Any
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError as error:  # the client-only install has no PyYAML
            raise InputError("reading YAML needs PyYAML (pip install 'kvplan[server]')") from error
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise InputError(f"{path}: not valid YAML: {error}") from error
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise InputError(f"{path}: not valid JSON: {error}") from error
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a mapping with engine_id, options, workers")
    try:
        return json_format.ParseDict(data, plan_pb2.PlanRequest())
    except json_format.ParseError as error:
        raise InputError(f"{path}: {error}") from error


def apply_hardware(request: plan_pb2.PlanRequest, gpu: str | None, gpu_memory: int | None) -> int:
    """Give every worker without a known device size the named GPU / size; returns how
    many workers took it."""
    taken = 0
    for worker in request.workers:
        if worker.device.total_memory_bytes or (gpu is None and gpu_memory is None):
            continue
        taken += 1
        if gpu_memory is not None:
            worker.device.total_memory_bytes = gpu_memory
        elif gpu is not None:
            worker.device.name = gpu
    return taken


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.2f} GiB"


def _enum(message: Any, field: str, prefix: str) -> str:
    descriptor = message.DESCRIPTOR.fields_by_name[field].enum_type
    return str(descriptor.values_by_number[getattr(message, field)].name).removeprefix(prefix)


def _stage_note(response: plan_pb2.PlanResponse) -> str:
    if response.plan_stage == plan_pb2.PLAN_STAGE_EXTENSIBLE_RESERVATION:
        return " (extensible KV cache: reservation, upper bounds until warm-up)"
    if response.plan_stage == plan_pb2.PLAN_STAGE_EXTENSIBLE_FINAL:
        return f" (extensible KV cache: final, reserved {response.reserved_num_blocks:,} blocks)"
    return ""


_EXTENSIBLE_STAGES = (
    plan_pb2.PLAN_STAGE_EXTENSIBLE_RESERVATION,
    plan_pb2.PLAN_STAGE_EXTENSIBLE_FINAL,
)


def format_report(response: plan_pb2.PlanResponse) -> str:
    """A readable report of a plan."""
    diagnostics = response.diagnostics
    lines = [
        f"engine {response.engine_id or '-'}  plan {response.plan_id}"
        f"  rules {response.rule_set or 'kvplan'}{_stage_note(response)}",
        f"grouping path: {_enum(diagnostics, 'grouping_path', 'GROUPING_PATH_').lower()}"
        f"   max_model_len: {response.max_model_len:,}   num_blocks: {response.num_blocks:,}",
        "",
        f"{'group':>5}  {'kind':<24} {'layers':>6} {'block':>6} {'page bytes':>12}  draft",
    ]
    for group in response.groups:
        kind: str = group.spec.WhichOneof("kind") or "-"
        if group.uniform_type:
            kind = f"{kind} (uniform type)"
        draft = "-"
        if group.is_draft:
            draft = f"yes ({_enum(group, 'draft_rule', 'DRAFT_RULE_').lower()})"
        padding = f"  +{group.padding_layers} padding" if group.padding_layers else ""
        lines.append(
            f"{group.group_id:>5}  {kind:<24} {len(group.layer_names):>6} {group.block_size:>6} "
            f"{group.page_size_bytes:>12,}  {draft}{padding}"
        )
    lines.append("")
    for worker in response.workers:
        budget = worker.budget
        mode = _enum(budget, "mode", "BUDGET_MODE_").lower()
        device = worker.device_uuid or "-"
        available = _gib(budget.available_bytes)
        if response.plan_stage in _EXTENSIBLE_STAGES:
            mode += ", reservation before warm-up"
        lines.append(
            f"rank {worker.rank} ({device}): budget {mode}, available {available}"
            + (
                f" = {_gib(budget.requested_bytes)} requested - {_gib(budget.non_kv_bytes)} non-KV"
                if budget.requested_bytes
                else ""
            )
        )
        lines.append(
            f"  {worker.bytes_per_block:,} bytes/block, {worker.num_blocks:,} blocks, "
            f"{len(worker.tensors)} tensors, {worker.kv_cache_size_tokens:,} tokens, "
            f"max concurrency {worker.max_concurrency:.2f}x at {worker.max_model_len:,} tokens"
        )
        if worker.encoder_only_layers:
            lines.append(f"  encoder-only layers (no KV cache): {len(worker.encoder_only_layers)}")
    lines.extend(["", *prefix_cache_lines(diagnostics)])
    if diagnostics.warnings:
        lines.append("")
        for warning in diagnostics.warnings:
            lines.append(f"warning: {warning.message}")
    return "\n".join(lines)


def prefix_cache_lines(diagnostics: plan_pb2.Diagnostics) -> list[str]:
    """The plan's prefix-cache summary and what-if answer (client/prefix_cache.py)."""
    from kvplan.client.prefix_cache import summary, what_if_line

    if not diagnostics.HasField("prefix_cache"):
        return []
    asked = what_if_line(diagnostics.prefix_cache)
    return [summary(diagnostics.prefix_cache), *([asked] if asked else [])]


def _ask_shared_prefix(request: plan_pb2.PlanRequest, args: argparse.Namespace) -> None:
    if getattr(args, "shared_prefix", None) is not None:
        request.shared_prefix_tokens = args.shared_prefix
    if getattr(args, "mamba_shared_prefix_checkpoint", False):
        request.options.enable_mamba_shared_prefix_checkpoint = True


def _plan_command(args: argparse.Namespace) -> int:
    from kvplan.core.errors import PlanningError

    try:
        request = load_request(args.file)
    except InputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    given = args.gpu is not None or args.gpu_memory is not None
    if given and request.workers and not apply_hardware(request, args.gpu, args.gpu_memory):
        flag = "--gpu-memory" if args.gpu_memory is not None else "--gpu"
        print(
            f"error: {flag} applies to workers without a device size, and every worker of "
            f"{args.file} states device.total_memory_bytes: edit the file (nothing is "
            "silently ignored)",
            file=sys.stderr,
        )
        return 2
    _ask_shared_prefix(request, args)
    if args.engine_version is not None:
        request.options.engine_version = args.engine_version
    try:
        if args.target:
            response = _plan_remote(args.target, request, args)
        else:
            from kvplan.convert import plan_from_proto

            response = plan_from_proto(request)
    except PlanningError as error:
        where = f"{error.field}: " if error.field else ""
        print(f"error: {where}{error.message}", file=sys.stderr)
        return EXIT_CODES.get(str(error.code), 1)
    except RemoteError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    if args.json:
        print(
            json.dumps(
                json_format.MessageToDict(response, preserving_proto_field_name=True), indent=1
            )
        )
    else:
        print(format_report(response))
    return 0


def _plan_model_command(args: argparse.Namespace) -> int:
    """`kvplan plan --model CONFIG`: the plan of the imported model plus its capacity."""
    from dataclasses import replace

    from kvplan.core.errors import PlanningError
    from kvplan.gpus import GpuModel, UnknownGpu
    from kvplan.models import ModelConfigError, load_config
    from kvplan.models.cli import (
        format_capacity,
        non_kv_lines,
        options_from_args,
        plan_built,
        resolve_gpu,
    )
    from kvplan.models.fit import catalog_name, explain_no_fit
    from kvplan.models.fleet import measured_options
    from kvplan.models.request import ModelPlanInputs, build_plan_request

    inputs: ModelPlanInputs | None = None
    try:
        if args.gpu is not None and args.gpu_memory is not None:
            raise ModelConfigError(
                "give --gpu NAME (or a size, --gpu 96GiB) or --gpu-memory BYTES, not both: "
                "with --model, --gpu-memory would replace the GPU's size"
            )
        config = load_config(args.model)
        gpu = resolve_gpu(args.gpu) if args.gpu_memory is None else None
        options = replace(
            options_from_args(args),
            tensor_parallel_size=args.tp or 1,
            gpu=catalog_name(gpu) if gpu is not None else None,
            gpu_memory_bytes=args.gpu_memory or (gpu.total_memory_bytes if gpu else None),
        )
        if options.gpu_memory_bytes is None:
            raise ModelConfigError("give --gpu NAME or --gpu-memory BYTES")
        source = fleet_source(args, config, options, gpu)  # kvplan/models/fleet.py
        options = measured_options(options, source)

        request, inputs = build_plan_request(config, options)
        response, summary, inputs = plan_built(request, inputs, _local_or_remote(args))
    except (ModelConfigError, UnknownGpu) as error:
        print(
            f"error: {error.args[0] if isinstance(error, UnknownGpu) else error}", file=sys.stderr
        )
        return 2
    except (PlanningError, RemoteError) as error:
        refusal = _no_fit_details(error)
        if refusal is not None:
            # Said in this command's terms: positive figures and its own flags, alike
            # locally and with --target. The alternatives (other TP sizes, GPUs) are
            # planned in-process: the same core as the server's, and no RPC per candidate.
            device = gpu or GpuModel("the device", options.gpu_memory_bytes or 0, True, "")
            local = _local_or_remote(argparse.Namespace(target=None))
            why = explain_no_fit(config, options, device, inputs, local, refusal)
            print(f"error: does not fit on {device.name} at TP {options.tensor_parallel_size}:",
                  file=sys.stderr)  # fmt: skip
            print("\n".join(why.lines()), file=sys.stderr)
            return EXIT_CODES["RESOURCE_EXHAUSTED"]
        if isinstance(error, PlanningError):
            where = f"{error.field}: " if error.field else ""
            print(f"error: {where}{error.message}", file=sys.stderr)
        else:
            print(f"error: {error}", file=sys.stderr)
        # Beside a refusal of the plan, not a connection or auth failure.
        refused = isinstance(error, PlanningError) or error.exit_code in (2, 3, 4, 5)
        if inputs is not None and refused:
            print("non-KV memory per worker the plan assumed:", file=sys.stderr)
            print("\n".join(non_kv_lines(inputs)), file=sys.stderr)
        if isinstance(error, PlanningError):
            return EXIT_CODES.get(str(error.code), 1)
        return error.exit_code
    if args.json:
        out = json_format.MessageToDict(response, preserving_proto_field_name=True)
        out["capacity"] = summary.as_dict()
        if inputs.final_sizings:
            # vLLM 0.34's extensible cache: num_blocks / capacity are the final size after
            # warm-up, estimated term by term here (one entry per pipeline stage);
            # reserved_num_blocks and capacity.reserved_* the reservation before it.
            out["extensible_final_sizing"] = [sizing.as_dict() for sizing in inputs.final_sizings]
        out["memory_source"] = source.as_dict()
        print(json.dumps(out, indent=1))
    else:
        print(format_report(response))
        print(format_capacity(summary, inputs, gpu))
        print(source.line())
        if options.max_model_len == -1:
            print(
                f"max_model_len auto: chose {response.max_model_len:,} tokens (the longest "
                "one request the KV budget holds)"
            )
    return 0


def fleet_source(args: argparse.Namespace, config: Any, options: Any, gpu: Any) -> Any:
    """The fleet's measurements of this configuration (with --target), or why none."""
    from kvplan.models.fleet import memory_source, remote_ask

    try:
        ask = remote_ask(args.target, security_environ(args)) if args.target else None
    except (OSError, ValueError) as error:
        raise connection_setup_error(error) from error
    return memory_source(config, options, gpu, ask)


def connection_setup_error(error: OSError | ValueError) -> RemoteError:
    """A channel that could not be set up: an unreadable TLS or token file, or a target
    without a port. Exit 2, as a bad flag."""
    if isinstance(error, OSError):
        return RemoteError(f"{error} (a TLS or token file)", 2)
    return RemoteError(str(error), 2)


def _no_fit_details(error: Exception) -> dict[str, int | float | str] | None:
    """The details of a RESOURCE_EXHAUSTED refusal, in-process or from a server (its
    ErrorInfo metadata, numbers as text there); None for any other error."""
    if not isinstance(error, RemoteError):
        code = getattr(error, "code", None)
        return dict(getattr(error, "details", {})) if code == "RESOURCE_EXHAUSTED" else None
    if error.exit_code != EXIT_CODES["RESOURCE_EXHAUSTED"]:
        return None
    metadata = getattr(error.__cause__, "metadata", {}) or {}
    if metadata.get("reason", "RESOURCE_EXHAUSTED") == "RESOURCE_EXHAUSTED":
        return None  # the server's own limit (its flag named), not the memory
    return {key: int(value) if value.isdigit() else value for key, value in metadata.items()}


def _local_or_remote(args: argparse.Namespace) -> Any:
    """`plan --model`'s planner. On a server the plan is a what-if, as `capacity
    --target`'s: no engine id, so the server claims no engine for this identity and
    publishes no plan under the model's name (GetPlan of a real engine unchanged)."""

    def planner(request: plan_pb2.PlanRequest) -> plan_pb2.PlanResponse:
        _ask_shared_prefix(request, args)
        if args.target:
            asked = plan_pb2.PlanRequest()
            asked.CopyFrom(request)
            asked.engine_id = ""
            return _plan_remote(args.target, asked, args)
        from kvplan.convert import plan_from_proto

        return plan_from_proto(request)

    return planner


class RemoteError(Exception):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# The TLS and token flags of every command that talks to a server, by the variable
# kvplan.client.security reads (a flag wins over the variable). No token on the command
# line, where `ps` would show it: KVPLAN_TOKEN or --token-file.
_SECURITY_FLAGS = {
    "tls": "KVPLAN_TLS",
    "tls_ca": "KVPLAN_TLS_CA",
    "client_cert": "KVPLAN_CLIENT_CERT",
    "client_key": "KVPLAN_CLIENT_KEY",
    "tls_server_name": "KVPLAN_TLS_SERVER_NAME",
    "token_file": "KVPLAN_CLIENT_TOKEN_FILE",
}


def add_security_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "connection and auth (with a server; each flag overrides its KVPLAN_* variable)"
    )
    group.add_argument(
        "--tls", action="store_const", const="1", help="TLS with the system roots (KVPLAN_TLS)"
    )
    group.add_argument("--tls-ca", help="CA bundle to verify the server (KVPLAN_TLS_CA)")
    group.add_argument("--client-cert", help="client certificate for mTLS (KVPLAN_CLIENT_CERT)")
    group.add_argument("--client-key", help="client private key for mTLS (KVPLAN_CLIENT_KEY)")
    group.add_argument(
        "--tls-server-name", help="name to verify in the server's certificate"
        " (KVPLAN_TLS_SERVER_NAME)",
    )  # fmt: skip
    group.add_argument(
        "--token-file",
        help="file holding the bearer token (KVPLAN_CLIENT_TOKEN_FILE; or KVPLAN_TOKEN)",
    )


def security_environ(args: argparse.Namespace | None) -> dict[str, str]:
    environ = dict(os.environ)
    for dest, variable in _SECURITY_FLAGS.items():
        value = getattr(args, dest, None) if args is not None else None
        if value:
            environ[variable] = value
    return environ


def _plan_remote(
    target: str, request: plan_pb2.PlanRequest, args: argparse.Namespace | None = None
) -> plan_pb2.PlanResponse:
    from kvplan.client import ChannelSecurity, PlannerClient, PlannerError

    try:
        security = ChannelSecurity.from_env(security_environ(args))
        with PlannerClient(target, security=security) as client:
            return client.plan(request).response
    except (OSError, ValueError) as error:  # a TLS or token file, a target without a port
        raise connection_setup_error(error) from error
    except PlannerError as error:
        raise RemoteError(remote_error_text(error), EXIT_CODES.get(error.code_name, 1)) from error


def remote_error_text(error: Any) -> str:
    """A server's answer (or no answer) in one line: the status code once, the field
    it names, the server's message (for no answer, the client's: what to check)."""
    field = f"{error.violations[0].field}: " if error.violations else ""
    hint = ""
    if error.code_name in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        hint = " -- check the token (--token-file, KVPLAN_TOKEN) and client certificate"
    return f"{error.code_name}: {field}{error.details}{hint}"


def _serve_command(argv: Sequence[str]) -> int:
    try:
        from kvplan.server.main import serve_main
    except ImportError as error:
        print(
            f"error: the server needs its extra dependencies (pip install 'kvplan[server]'): "
            f"{error}",
            file=sys.stderr,
        )
        return 1
    return serve_main(list(argv))


def default_health_target(environ: Mapping[str, str] | None = None) -> str:
    """The local server as `kvplan serve` would bind it from the same KVPLAN_* variables:
    a container's HEALTHCHECK then follows KVPLAN_PORT / KVPLAN_HOST overrides."""
    env = os.environ if environ is None else environ
    host = env.get("KVPLAN_HOST", "") or "0.0.0.0"
    if host in ("0.0.0.0", "::", "[::]", "auto"):  # a wildcard bind answers on loopback
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal
    return f"{host}:{env.get('KVPLAN_PORT', '') or '50051'}"


def _health_channel(target: str, args: argparse.Namespace | None = None) -> Any:
    """Plaintext, or TLS when KVPLAN_TLS_CA / KVPLAN_CLIENT_CERT / KVPLAN_TLS say so
    (kvplan.client.security). A health probe never goes through an HTTP proxy."""
    import grpc

    from kvplan.client import ChannelSecurity
    from kvplan.client.targets import with_default_port

    security = ChannelSecurity.from_env(security_environ(args))
    target = with_default_port(target)
    options = [("grpc.enable_http_proxy", 0), *security.channel_options()]
    credentials = security.credentials()
    if credentials is None:
        return grpc.insecure_channel(target, options=options)
    return grpc.secure_channel(target, credentials, options=options)


def _health_command(args: argparse.Namespace) -> int:
    """grpc.health.v1.Health/Check: 0 only for SERVING; always one line of output."""
    try:  # only here: `kvplan plan` needs nothing but the base install
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
    except ImportError as error:
        print(
            f"error: kvplan health needs grpcio-health-checking "
            f"(pip install 'kvplan[server]'): {error}",
            file=sys.stderr,
        )
        return 1
    from kvplan.client import ChannelSecurity

    service = args.service or "(server)"
    try:
        # A health probe goes straight to the target, never through an HTTP proxy.
        with _health_channel(args.target, args) as channel:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
    except ValueError as error:  # a target with an empty port
        print(f"error: {error}", file=sys.stderr)
        return 2
    except grpc.RpcError as error:
        code = error.code()
        name = code.name if code is not None else "UNKNOWN"
        details = " ".join(str(error.details() or "").split())
        suffix = f": {details}" if details else ""
        if name == "UNAVAILABLE" and not error.trailing_metadata():
            from kvplan.client.errors import unreachable_text
            from kvplan.client.targets import with_default_port

            security = ChannelSecurity.from_env(security_environ(args))
            suffix = ": " + unreachable_text(
                with_default_port(args.target),
                str(error.details() or ""),
                tls=security.tls,
                token=security.token is not None,
            )
        print(f"error: {args.target} {service}: {name}{suffix}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    print(f"{args.target} {service}: {status}")
    return 0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text.replace(",", "").replace("_", ""))
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from kvplan.models.cli import (
        add_calibrate_parser,
        add_capacity_parser,
        add_model_options,
        parse_size,
    )

    parser = argparse.ArgumentParser(
        prog="kvplan",
        description=(
            "Plan the KV cache of an LLM inference engine "
            "(the rules of vLLM 0.32, 0.33 or 0.34, or kvplan's own)."
        ),
        epilog=__doc__.split("\n\n", 1)[1] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    plan = commands.add_parser("plan", help="plan a request file (YAML or JSON)")
    plan.add_argument(
        "file", nargs="?", help="PlanRequest in the proto JSON mapping (.yaml/.yml/.json)"
    )
    plan.add_argument("--json", action="store_true", help="print the PlanResponse as JSON")
    plan.add_argument(
        "--gpu",
        help="device name for workers without a device size, e.g. H100-80GB; with --model "
        "also a size (96GiB)",
    )
    plan.add_argument(
        "--gpu-memory", type=parse_size, help="device total memory: bytes, 80GiB, 81559MiB"
    )
    plan.add_argument(
        "--target",
        help="plan on a server at HOST:PORT instead of in-process (HOST alone: port 50051)",
    )
    plan.add_argument(
        "--engine-version",
        help="rule set of the engine release that will run the plan: vllm-0.32, vllm-0.33, "
        "vllm-0.34, or '' for kvplan's own rules (overrides options.engine_version); with "
        "--model it also picks the release's layer registration",
    )
    plan.add_argument(
        "--shared-prefix",
        type=_non_negative_int,
        metavar="N",
        help="what-if: how many of N tokens repeated from an earlier request this engine "
        "serves from its prefix cache (PlanRequest.shared_prefix_tokens)",
    )
    plan.add_argument(
        "--mamba-shared-prefix-checkpoint",
        action="store_true",
        help="the engine runs with vLLM's --enable-mamba-shared-prefix-checkpoint "
        "(options.enable_mamba_shared_prefix_checkpoint): Mamba state kept at the "
        "shared-prefix junction, which the what-if's next request can hit",
    )
    add_model_options(plan, sweep=False)
    add_security_options(plan)
    add_capacity_parser(commands)
    add_calibrate_parser(commands)
    commands.add_parser("serve", help="run the gRPC service", add_help=False)
    health = commands.add_parser(
        "health",
        help="check a server with grpc.health.v1 (exit 0 only when SERVING)",
        description="Call grpc.health.v1.Health/Check; exit 0 when SERVING, 1 otherwise.",
    )
    health.add_argument(
        "--target",
        default=default_health_target(),
        help="HOST:PORT of the server (default from KVPLAN_HOST / KVPLAN_PORT: %(default)s)",
    )
    health.add_argument(
        "--service",
        default="",
        help="service name to check, e.g. kvplan.v1.KVCachePlanner (default: the whole server)",
    )
    health.add_argument(
        "--timeout",
        type=_positive_float,
        default=3.0,
        help="seconds to wait for the answer (default %(default)s)",
    )
    add_security_options(health)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        code = _main(argv)
        sys.stdout.flush()  # in here: a pipe closed early is met now, not at exit
        return code
    except BrokenPipeError:
        # The reader left (`kvplan plan ... | head`): no traceback, and no second
        # error when Python flushes stdout at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _model_flags_given(args: argparse.Namespace) -> list[str]:
    """The --model deployment flags present on the command line (none has a default)."""
    from kvplan.models.cli import MODEL_ONLY_OPTIONS

    return [flag for dest, flag in MODEL_ONLY_OPTIONS.items() if getattr(args, dest) is not None]


def _main(argv: Sequence[str] | None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "serve":
        return _serve_command(args_list[1:])
    args = build_parser().parse_args(args_list)
    if args.command == "plan":
        if args.model and args.file:
            print(
                f"error: give a request FILE ({args.file}) or --model CONFIG, not both: a "
                "request file already lists its layers",
                file=sys.stderr,
            )
            return 2
        if args.model:
            return _plan_model_command(args)
        if not args.file:
            print("error: give a request FILE or --model CONFIG", file=sys.stderr)
            return 2
        refused = _model_flags_given(args)
        if refused:
            print(
                f"error: {', '.join(refused)} appl{'ies' if len(refused) == 1 else 'y'} to "
                "--model only: a request file states its workers, options and memory itself "
                "(edit the file; --gpu, --gpu-memory and --engine-version do apply to it)",
                file=sys.stderr,
            )
            return 2
        return _plan_command(args)
    if args.command == "capacity":
        from kvplan.models.cli import capacity_command

        return capacity_command(args)
    if args.command == "calibrate":
        from kvplan.models.cli import calibrate_command

        return calibrate_command(args)
    if args.command == "health":
        return _health_command(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
