"""`moescope import` and `moescope proxy`: engines' routing into a store, from files or live.

`moescope/cli/__init__.py` calls `add_subcommands(subparsers)`; each subcommand sets `func(args) -> int`.
"""

from __future__ import annotations

import argparse
import sys

from moescope.cli import command_help
from moescope.cli.arguments import add_store_arguments, positive_int, positive_number, store_epilog, store_location
from moescope.cli.check import add_engine_map_arguments, engine_map_from
from moescope.core.lifecycle import add_grace_period_argument

IMPORT_HELP = """\
Bring an engine's routing into a store, as a new run the dashboard, rules and queries read like
a probed one. Every file is checked before anything is written: a bad one gets one line naming
the file, the place in it and what was expected, and nothing is written. A file given twice (the
same path, or the same bytes) is refused. Large files are read in pieces (memory follows a piece,
not the file: JSON Lines, a JSON list of responses, .npy, CSV and traces; a JSON document of one
response, a .pt dump and a TensorRT-LLM rank file are read whole), and progress shows on stderr
when a pass takes more than a few seconds.

  vllm      responses of a server started with --enable-return-routed-experts (JSON, JSON Lines,
            streamed chunks), or CompletionOutput.routed_experts saved as .npy (or base64 of it);
            [tokens, layers, top_k] ids, -1 for a row not computed (prefix-cache hit)
  sglang    expert_distribution_recorder_*.pt dumps (stat, per_pass, per_token), the legacy CSV,
            or /generate responses: meta_info.routed_experts is base64 of little-endian int32,
            shape (seq_len - 1, num_hidden_layers, top_k), so pass --num-layers and --top-k.
            per_pass/per_token dumps map physical slots with the map in force at dump time
            (last_physical_to_logical_map); under EPLB rebalancing, passes before a rebalance may
            be mapped wrongly: steps are tagged expert_map=<hash> so a change shows; dump after
            each rebalance to be exact
  trtllm    the EXPERT_STATISTIC_PATH folder (meta_info.json, rank*.safetensors); with its load
            balancer on these count physical slots, not experts: pass --num-experts to have that
            refused rather than imported as experts
  megatron  the --moe-routing-trace-path folder or its router_trace_rank*.jsonl files; the trace's
            "stage" ("pre_dispatch") is where in the router it recorded, not a pipeline stage:
            steps are tagged trace_stage=<stage>

Expert ids must be in 0..E-1 (E: --num-experts, else the largest id seen + 1 up to --max-experts,
65536 by default); -1 only where a format means "not computed". Router logits, entropy, gate
weights, drops and parameter counts are not in these files: they are left empty and the
dashboard says "not recorded by this source".

example:  moescope import vllm responses.jsonl --store runs/ --tag router=v2
          moescope import sglang dumps/*.pt --store runs/ --top-k 8
          moescope import trtllm expert_statistic/ --store runs/ --num-experts 256
"""

PROXY_HELP = """\
Record the routed experts a vLLM or SGLang server returns, per request, while forwarding
requests and responses unchanged (streaming included). Requests carrying x-router-version or
x-moescope-tag-<key> headers are tagged with them, so the compare page can set router v1 against
v2. Writing happens on a background thread with a bounded queue: a full queue drops and counts a
record, never delays a response. Listens on 127.0.0.1 unless told otherwise.

SIGTERM (how systemd, Docker and Kubernetes stop a service) or Ctrl-C stops it cleanly: no new
requests are taken, the ones in flight are answered, everything captured is written with the
run's final counts (probe_stats), and it exits 0, within --grace-period seconds (else status 1,
saying what was lost). A second signal exits at once.

Bounds: --max-connections client connections at most (when all are taken, the one idle longest is
closed to make room; with none idle, new clients wait until one is free), each closed after
--idle-timeout seconds without a request; a request's line and headers must arrive within --header-timeout, each
piece of its body and each write of the response within --read-timeout; the engine must answer
within --upstream-timeout per read. Bodies are streamed, never held whole; a request the client
cut short never reaches the engine whole. If the engine fails mid-response the client's connection
is closed at once and the response counted (upstream_incomplete, upstream_timeout).

Privacy: prompt and generated token ids are not stored (routes.token_id is null) unless
--record-token-ids is given: with the model's tokenizer they are the users' text. Credentials in
--upstream (http://USER:PASSWORD@HOST:PORT) are sent as an Authorization: Basic header and never
printed or returned to clients (the command line itself is visible to other local users in ps).

If the recorder stops (it should not: a body it cannot read is counted and skipped), the proxy
answers 503, says so, and exits 1 rather than pass traffic it cannot record.

Trace checks: every response's routing is checked as it is recorded (the checks: `moescope check
--help`); what they find is written with the run (trace_findings) and said in the last line. With
--placement FILE, the engine's map (JSON or YAML as `moescope placement` reads it, with the load
the engine recorded beside it where it has one, or an SGLang recorder dump .pt; --ranks N where it
does not say the expert-parallel size), they also look for physical (post-EPLB) ids where training
needs logical ones (physical_ids): ids past the map's logical experts, or counts per id that match
the load the engine recorded per physical slot better than per expert. The map must hold
--num-experts logical experts; a bad map stops the proxy before it starts. A response naming a
slot past --num-experts is counted by physical_ids, then refused (bad_routing) as any id out of
range is. The responses of each flush (every 2 s or 256 responses) are judged together.

example:  moescope proxy --upstream http://127.0.0.1:8000 --store runs/ --num-experts 64
          then send requests to http://127.0.0.1:8100 instead of :8000
          moescope proxy --upstream http://127.0.0.1:8000 --store runs/ --num-experts 256 \\
              --placement eplb_map.json --ranks 32
"""


def add_subcommands(subparsers: argparse._SubParsersAction) -> None:
    """Register import and proxy on the moescope command's subparsers."""
    from moescope.ingest.importers import KINDS, MAX_EXPERTS

    raw = argparse.RawDescriptionHelpFormatter
    p = subparsers.add_parser("import", help=command_help("import"),
                              description=IMPORT_HELP, formatter_class=raw,
                              epilog=store_epilog("moescope import vllm responses.jsonl --store STORE"))
    p.add_argument("kind", choices=KINDS, help="which engine wrote the files")
    p.add_argument("paths", nargs="+", metavar="PATH", help="files or folders to read")
    add_store_arguments(p, option=True, what="the store to write the run into: a folder or a URL "
                                             "(s3://BUCKET/PREFIX, gs://..., az://...)")
    p.add_argument("--run-id", help="id of the new run (default: time, source and a random suffix)")
    p.add_argument("--tag", action="append", default=[], metavar="K=V", help="tag the run and its steps (repeatable)")
    p.add_argument("--num-experts", type=int, help="routed experts per layer (default: from the files, else the "
                                                   "largest id seen + 1)")
    p.add_argument("--max-experts", type=int, default=MAX_EXPERTS,
                   help=f"refuse expert ids and counts of more experts than this per layer (default {MAX_EXPERTS}: "
                        "a larger id is a corrupt or wrapped value)")
    p.add_argument("--top-k", type=int, help="experts per token; needed where the files only count slots")
    p.add_argument("--num-layers", type=int, help="layers in SGLang's flat meta_info.routed_experts")
    p.add_argument("--model", help="model name shown for the run (default: from the files)")
    p.add_argument("--in-order", action="store_true",
                   help="SGLang stat dumps: the buffer was unbounded (size -1), so a full buffer is still in order")
    add_engine_map_arguments(p)
    p.set_defaults(func=_import)

    p = subparsers.add_parser("proxy", help=command_help("proxy"),
                              description=PROXY_HELP, formatter_class=raw,
                              epilog=store_epilog("moescope proxy --upstream http://127.0.0.1:8000 --num-experts 64 "
                                                  "--store STORE"))
    p.add_argument("--upstream", required=True, help="the engine's base URL, e.g. http://127.0.0.1:8000")
    add_store_arguments(p, option=True, what="the store to write the run into: a folder or a URL "
                                             "(s3://BUCKET/PREFIX, gs://..., az://...)")
    p.add_argument("--listen", default="127.0.0.1:8100", help="address to listen on (default 127.0.0.1:8100)")
    p.add_argument("--num-experts", type=int, required=True, help="routed experts per MoE layer of the model")
    p.add_argument("--num-layers", type=int, help="SGLang: layers in meta_info.routed_experts")
    p.add_argument("--top-k", type=int, help="SGLang: experts per token in meta_info.routed_experts")
    p.add_argument("--run-id", help="id of the new run (default: time, source and a random suffix)")
    p.add_argument("--tag", action="append", default=[], metavar="K=V", help="tag the run and its steps (repeatable)")
    p.add_argument("--max-queue", type=positive_int, default=1024,
                   help="responses waiting to be recorded before new ones are dropped and counted (default 1024)")
    p.add_argument("--max-queue-mb", type=positive_number, default=256, metavar="MIB",
                   help="MiB of response bodies waiting to be recorded before new ones are dropped and counted; as "
                        "much again may be held by responses being captured (default 256)")
    p.add_argument("--record-token-ids", action="store_true",
                   help="store each token's id in routes.token_id (off by default: with a tokenizer they give the "
                        "prompts back, which is personal data for a proxy in front of users)")
    p.add_argument("--max-connections", type=positive_int, default=256,
                   help="client connections at most; when all are taken the one idle longest is closed, and with "
                        "none idle new clients wait for one to be free (default 256)")
    p.add_argument("--idle-timeout", type=positive_number, default=60.0, metavar="SECONDS",
                   help="close a connection that waits this long for a request (default 60)")
    p.add_argument("--header-timeout", type=positive_number, default=10.0, metavar="SECONDS",
                   help="a request's line and headers must arrive within this, all together (default 10)")
    p.add_argument("--read-timeout", type=positive_number, default=60.0, metavar="SECONDS",
                   help="longest wait for a client to send the next piece of a body or take the next piece of a "
                        "response (default 60)")
    p.add_argument("--upstream-timeout", type=positive_number, default=600.0, metavar="SECONDS",
                   help="longest wait for the engine to connect or send the next bytes; a non-streamed generation "
                        "sends nothing until it is done (default 600)")
    add_engine_map_arguments(p)
    add_grace_period_argument(p, "stop accepting, answer the requests in flight and record what was captured")
    p.set_defaults(func=_proxy)



def _import(args: argparse.Namespace) -> int:
    from moescope.ingest.importers import import_files
    from moescope.ingest.importers.tables import parse_tags

    summary = import_files(args.kind, args.paths, store_location(args), run_id=args.run_id, tags=parse_tags(args.tag),
                           num_experts=args.num_experts, top_k=args.top_k, num_layers=args.num_layers,
                           model=args.model, in_order=args.in_order, max_experts=args.max_experts,
                           engine_map=engine_map_from(args))
    print(summary.report())
    return 0


def _proxy(args: argparse.Namespace) -> int:
    from moescope.core.lifecycle import GracefulStop, grace_period_s
    from moescope.ingest.importers.tables import parse_tags
    from moescope.ingest.proxy import ProxyLimits, RoutingProxy, parse_listen, parse_upstream

    host, port = parse_listen(args.listen)
    parse_upstream(args.upstream)  # a bad URL is refused before the store is touched
    grace_s = grace_period_s(args.grace_period)  # a bad value is refused before anything starts
    engine_map = engine_map_from(args)  # a bad map too, before the store is touched
    location = store_location(args)
    limits = ProxyLimits(max_connections=args.max_connections, idle_timeout_s=args.idle_timeout,
                         header_timeout_s=args.header_timeout, read_timeout_s=args.read_timeout,
                         upstream_timeout_s=args.upstream_timeout)
    proxy = RoutingProxy(args.upstream, location, num_experts=args.num_experts, host=host, port=port,
                         run_id=args.run_id, tags=parse_tags(args.tag), num_layers=args.num_layers,
                         top_k=args.top_k, max_queue=args.max_queue, limits=limits,
                         max_queue_bytes=int(args.max_queue_mb * 2**20), record_token_ids=args.record_token_ids,
                         engine_map=engine_map)
    with GracefulStop(on_stop=proxy.stop_accepting, grace_s=grace_s, what="moescope proxy",
                      on_exit=lambda status: print(proxy.recorder.report(), flush=True)):
        # said once the signals are handled: a supervisor that waits for this line may stop it at once
        print(f"moescope proxy: http://{proxy.host}:{proxy.port} -> {proxy.upstream_url}, recording run "
              f"{proxy.recorder.spec.run_id} into {location.redacted}"
              + (f", trace checks against the engine map {engine_map.source}" if engine_map else ""), flush=True)
        try:
            proxy.serve_forever()  # returns once a signal stopped the server taking requests
        finally:
            proxy.shutdown(timeout_s=grace_s)  # answer what is in flight, drain, write the final counts
    print(proxy.recorder.report(), flush=True)
    if proxy.failure:
        print(f"moescope proxy: stopped because {proxy.failure}; the engine's later traffic was not recorded",
              file=sys.stderr, flush=True)
        return 1
    return 0
