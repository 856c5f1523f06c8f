"""A test double of an SGLang server: the built-in torch engine behind SGLang's HTTP API.

`python -m tests.doubles.sglang_server --model-path builtin:tiny --port 30000 ...` (from the
repository's root) takes the flags that `rollout/sglang/server_args.py` builds for SGLang (the
ones it cannot use, such as --mem-fraction-static, are accepted and reported by /server_info) and
answers the endpoints the adapter calls with SGLang 0.5.23's request and response shapes. So the
SGLang adapter is tested for real, across processes, on a CPU; the launcher starts it in place of
SGLang when given `program(...)`. The weight-update group is a real process group built with
`weight_sync/broadcast.py:open_weights_group`, the recipe SGLang uses.

Where it cannot do what SGLang does, it answers as SGLang answers a call that fails:
/update_weights_from_tensor (a pickle of CUDA IPC handles) and load_format 'flattened_bucket'
get `{"success": false, "message": ...}` with 400; a pause in 'abort' mode lets the one batch in
flight finish instead of aborting it (generation here is one uninterruptible batch); requests
made while paused wait for /continue_generation, as SGLang's do. Two fault hooks exist for
failure tests only: --fault-exit-on-generate N exits the process while serving the N-th
/generate, --fault-unavailable-generates N answers the first N with 503.
Standard library, torch and the built-in engine only; must not depend on sglang or Ray.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
import torch.distributed as dist

from ppo_trainer.rollout.base import SamplingParams
from ppo_trainer.rollout.sglang.server_args import ServerProgram
from ppo_trainer.rollout.torch_engine import TorchRolloutEngine
from ppo_trainer.weight_sync.broadcast import close_weights_group, open_weights_group, receive_bucket, torch_dtype
from ppojob_api.spec import ModelSpec

logger = logging.getLogger("tests.doubles.sglang_server")

VERSION = "0.5.23-builtin"
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")


class RequestError(Exception):
    """An answer other than 200: status and JSON body."""

    def __init__(self, status: int, body: Any):
        super().__init__(str(body))
        self.status, self.body = status, body


def _error(message: str, status: int = HTTPStatus.BAD_REQUEST) -> RequestError:
    """SGLang's `_create_error_response` shape."""
    return RequestError(status, {"error": {"message": message}})


def _require(body: dict, *fields: str) -> None:
    """FastAPI's 422 for missing required fields."""
    missing = [f for f in fields if f not in body]
    if missing:
        detail = [{"type": "missing", "loc": ["body", f], "msg": "Field required", "input": body} for f in missing]
        raise RequestError(HTTPStatus.UNPROCESSABLE_ENTITY, {"detail": detail})


class BuiltinServer:
    """The state behind the endpoints: the engine, the pause flag, released memory, weight groups."""

    def __init__(self, *, args: argparse.Namespace, engine: TorchRolloutEngine) -> None:
        self.args = args
        self.engine = engine
        self.weight_version = "default"
        self.released: set[str] = set()
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.engine_lock = threading.Lock()
        self.pause = threading.Condition()
        self.paused = False
        self.generates_seen = 0
        self.counter_lock = threading.Lock()

    # --- endpoints -----------------------------------------------------------------------------

    def model_info(self, _body: dict) -> dict:
        return {
            "model_path": self.args.model_path,
            "tokenizer_path": self.args.tokenizer_path or self.args.model_path,
            "is_generation": True,
            "weight_version": self.weight_version,
        }

    def server_info(self, _body: dict) -> dict:
        return {**{k: v for k, v in vars(self.args).items() if not k.startswith("fault")}, "version": VERSION}

    def generate(self, body: dict) -> Any:
        self._count_generate()
        input_ids = body.get("input_ids")
        if input_ids is None:
            raise _error("the built-in server takes input_ids only (it has no tokenizer for text)")
        single = bool(input_ids) and isinstance(input_ids[0], int)
        prompts = [input_ids] if single else input_ids
        params = body.get("sampling_params") or {}
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise _error(f"sampling_params has {len(per_prompt)} entries for {len(prompts)} prompts")
        with self.pause:
            self.pause.wait_for(lambda: not self.paused)
        with self.engine_lock:
            if self.released:
                raise _error(
                    f"memory released ({', '.join(sorted(self.released))}): call /resume_memory_occupation first"
                )
            results = self._generate(prompts, per_prompt, return_logprob=bool(body.get("return_logprob")))
        return results[0] if single else results

    def pause_generation(self, body: dict) -> dict:
        mode = body.get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            raise _error(f"mode {mode!r} is not one of abort, retract, in_place", HTTPStatus.UNPROCESSABLE_ENTITY)
        with self.pause:
            self.paused = True
        with self.engine_lock:  # the batch in flight, if any, has finished
            pass
        return {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, _body: dict) -> dict:
        with self.pause:
            self.paused = False
            self.pause.notify_all()
        return {"message": "Generation continued successfully.", "status": "ok"}

    def flush_cache(self, _body: dict) -> str:
        return (
            "Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n"
        )

    def release_memory_occupation(self, body: dict) -> None:
        tags = self._tags(body)
        with self.engine_lock:
            if "weights" in tags and "weights" not in self.released:
                self.engine.sleep()
            self.released |= set(tags)

    def resume_memory_occupation(self, body: dict) -> None:
        tags = self._tags(body)
        with self.engine_lock:
            if "weights" in tags and "weights" in self.released:
                self.engine.wake_up()
            self.released -= set(tags)

    def init_weights_update_group(self, body: dict) -> dict:
        _require(body, "master_address", "master_port", "rank_offset", "world_size")
        name = body.get("group_name", "weight_update_group")
        if name in self.groups:
            return {"success": False, "message": f"Failed to initialize custom process group: group {name} exists."}
        try:
            self.groups[name] = open_weights_group(
                master_address=body["master_address"],
                master_port=int(body["master_port"]),
                rank=int(body["rank_offset"]),
                world_size=int(body["world_size"]),
                group_name=name,
                backend=body.get("backend", "nccl"),
            )
        except Exception as exc:  # noqa: BLE001 - answered to the caller, as SGLang does
            return {"success": False, "message": f"Failed to initialize custom process group: {exc}."}
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def update_weights_from_distributed(self, body: dict) -> dict:
        _require(body, "names", "dtypes", "shapes")
        name = body.get("group_name", "weight_update_group")
        if body.get("load_format") == "flattened_bucket":
            return {"success": False, "message": "load_format 'flattened_bucket' is not supported by the built-in server"}
        group = self.groups.get(name)
        if group is None:
            return {
                "success": False,
                "message": f"Group {name} not in {list(self.groups)}. Please call `init_weights_update_group` first.",
            }
        try:
            for dtype in body["dtypes"]:
                torch_dtype(dtype)  # refuse a bad bucket before joining its broadcasts
        except TypeError as exc:
            return {"success": False, "message": str(exc)}
        with self.engine_lock:
            received = receive_bucket(group, names=body["names"], dtypes=body["dtypes"], shapes=body["shapes"],
                                       device=self.engine.device)
            try:
                self.engine.update_weights(received)
            except ValueError as exc:
                return {"success": False, "message": f"Failed to update weights: {exc}"}
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return {"success": True, "message": "Succeeded to update parameter online from distributed."}

    def update_weights_from_tensor(self, body: dict) -> dict:
        _require(body, "serialized_named_tensors")
        return {
            "success": False,
            "message": "update_weights_from_tensor is not supported by the built-in server: its payload is a pickle "
            "of CUDA IPC handles, which needs a GPU shared with the sender; use update_weights_from_distributed",
        }

    def destroy_weights_update_group(self, body: dict) -> dict:
        name = body.get("group_name", "weight_update_group")
        group = self.groups.pop(name, None)
        if group is None:
            return {"success": False, "message": "The group to be destroyed does not exist."}
        close_weights_group(group)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    # --- helpers -------------------------------------------------------------------------------

    def _count_generate(self) -> None:
        with self.counter_lock:
            self.generates_seen += 1
            seen = self.generates_seen
        if self.args.fault_exit_on_generate and seen == self.args.fault_exit_on_generate:
            logger.error("fault hook: exiting while serving /generate number %d", seen)
            os._exit(17)
        if seen <= self.args.fault_unavailable_generates:
            raise _error("fault hook: server unavailable", HTTPStatus.SERVICE_UNAVAILABLE)

    def _tags(self, body: dict) -> list[str]:
        tags = body.get("tags") or list(MEMORY_TAGS)
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown:
            raise _error(f"unknown memory tags {unknown}; use among {list(MEMORY_TAGS)}")
        return tags

    def _generate(self, prompts: list[list[int]], per_prompt: list[dict], *, return_logprob: bool) -> list[dict]:
        """One engine call per distinct (max_new_tokens, temperature, top_p); seeded by the group's first seed."""
        groups: dict[tuple, list[int]] = {}
        for index, params in enumerate(per_prompt):
            key = (int(params.get("max_new_tokens", 128)), float(params.get("temperature", 1.0)), float(params.get("top_p", 1.0)))
            groups.setdefault(key, []).append(index)
        results: list[dict] = [{} for _ in prompts]
        for (max_new_tokens, temperature, top_p), indices in groups.items():
            seed = per_prompt[indices[0]].get("sampling_seed")
            params = SamplingParams(
                max_new_tokens=max_new_tokens,
                temperature=temperature,
                top_p=top_p,
                seed=int(seed if seed is not None else (self.args.random_seed or 0)),
            )
            try:
                generation = self.engine.generate([prompts[i] for i in indices], params)
            except ValueError as exc:
                raise _error(str(exc)) from None
            for row, index in enumerate(indices):
                length = int(generation.response_mask[row].sum())
                ids = generation.response_tokens[row, :length].tolist()
                log_probs = generation.log_probs[row, :length].tolist()
                results[index] = self._result(index, prompts[index], ids, log_probs, max_new_tokens, return_logprob)
        return results

    def _result(
        self, index: int, prompt: list[int], ids: list[int], log_probs: list[float], limit: int, return_logprob: bool
    ) -> dict:
        eos = self.engine.eos_token_id
        finish = {"type": "stop", "matched": eos} if ids and ids[-1] == eos else {"type": "length", "length": limit}
        meta: dict[str, Any] = {
            "id": f"builtin-{os.getpid()}-{self.generates_seen}-{index}",
            "finish_reason": finish,
            "prompt_tokens": len(prompt),
            "weight_version": self.weight_version,
            "completion_tokens": len(ids),
            "cached_tokens": 0,
        }
        if return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(log_probs, ids)]
        result: dict[str, Any] = {"output_ids": ids, "meta_info": meta}
        if not self.args.skip_tokenizer_init:
            from ppo_trainer.models.tokenizer import load_tokenizer

            result["text"] = load_tokenizer(_model_spec(self.args)).decode(ids)
        return result


ROUTES = {
    ("GET", "/health"): None,
    ("GET", "/health_generate"): None,
    ("GET", "/model_info"): "model_info",
    ("GET", "/get_model_info"): "model_info",
    ("GET", "/server_info"): "server_info",
    ("POST", "/generate"): "generate",
    ("PUT", "/generate"): "generate",
    ("POST", "/pause_generation"): "pause_generation",
    ("POST", "/continue_generation"): "continue_generation",
    ("GET", "/flush_cache"): "flush_cache",
    ("POST", "/flush_cache"): "flush_cache",
    ("GET", "/release_memory_occupation"): "release_memory_occupation",
    ("POST", "/release_memory_occupation"): "release_memory_occupation",
    ("GET", "/resume_memory_occupation"): "resume_memory_occupation",
    ("POST", "/resume_memory_occupation"): "resume_memory_occupation",
    ("POST", "/init_weights_update_group"): "init_weights_update_group",
    ("POST", "/update_weights_from_distributed"): "update_weights_from_distributed",
    ("POST", "/update_weights_from_tensor"): "update_weights_from_tensor",
    ("POST", "/destroy_weights_update_group"): "destroy_weights_update_group",
}


def make_handler(server: BuiltinServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_POST(self) -> None:
            self._dispatch("POST")

        def do_PUT(self) -> None:
            self._dispatch("PUT")

        def log_message(self, format: str, *args: Any) -> None:
            logger.debug("%s " + format, self.address_string(), *args)

        def _dispatch(self, method: str) -> None:
            path = self.path.split("?", 1)[0]
            if (method, path) not in ROUTES:
                known = any(p == path for _, p in ROUTES)
                status = HTTPStatus.METHOD_NOT_ALLOWED if known else HTTPStatus.NOT_FOUND
                self._drain()
                self._send(status, {"detail": "Method Not Allowed" if known else "Not Found"})
                return
            try:
                body = self._body()
                name = ROUTES[(method, path)]
                answer = getattr(server, name)(body) if name else ""
            except RequestError as exc:
                self._send(exc.status, exc.body)
                return
            except Exception as exc:  # a server answers, it does not die
                logger.exception("%s %s failed", method, path)
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": {"message": f"{type(exc).__name__}: {exc}"}})
                return
            status = HTTPStatus.OK
            if isinstance(answer, dict) and answer.get("success") is False:
                status = HTTPStatus.BAD_REQUEST
            self._send(status, answer)

        def _drain(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _body(self) -> dict:
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if not raw:
                return {}
            try:
                body = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise RequestError(HTTPStatus.UNPROCESSABLE_ENTITY, {"detail": f"JSON decode error: {exc}"}) from None
            if not isinstance(body, dict):
                raise RequestError(HTTPStatus.UNPROCESSABLE_ENTITY, {"detail": "the body must be a JSON object"})
            return body

        def _send(self, status: int, answer: Any) -> None:
            if isinstance(answer, str):
                data, kind = answer.encode(), "text/plain; charset=utf-8"
            else:
                data, kind = json.dumps(answer).encode(), "application/json"
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def program(*args: str) -> ServerProgram:
    """This server as the SGLang launcher runs it in SGLang's place, with `args` (its own flags,
    e.g. --model-seed, --device) after the spec's."""
    return ServerProgram(module="tests.doubles.sglang_server", args=args, on_gpu=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tests.doubles.sglang_server", description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", "--model", dest="model_path", required=True)
    parser.add_argument("--tokenizer-path", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    parser.add_argument("--mem-fraction-static", type=float, default=None, help="accepted, unused on a CPU")
    parser.add_argument("--base-gpu-id", type=int, default=0, help="the GPU to serve on with --device cuda")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--random-seed", type=int, default=None)
    parser.add_argument("--model-seed", type=int, default=None, help="seed of builtin:tiny's random weights (default: --random-seed)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--skip-tokenizer-init", action="store_true")
    parser.add_argument("--enable-memory-saver", action="store_true", help="accepted; release/resume always work here")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true", help="accepted; released weights are always kept")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--fault-exit-on-generate", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--fault-unavailable-generates", type=int, default=0, help=argparse.SUPPRESS)
    return parser


def _model_spec(args: argparse.Namespace) -> ModelSpec:
    return ModelSpec(path=args.model_path, tokenizer=args.tokenizer_path, dtype=args.dtype)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tp_size != 1:
        parser.error(f"--tp-size {args.tp_size}: the built-in server runs one device; use --tp-size 1")
    logging.basicConfig(level=args.log_level.upper(), format="[%(asctime)s] %(name)s: %(message)s")
    seed = args.model_seed if args.model_seed is not None else (args.random_seed or 0)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", args.base_gpu_id)
        torch.cuda.set_device(device)  # the device NCCL groups made here (weight updates) use
    engine = TorchRolloutEngine(model_spec=_model_spec(args), device=device, seed=seed)
    state = BuiltinServer(args=args, engine=engine)
    httpd = ThreadingHTTPServer((args.host, args.port), make_handler(state))
    httpd.daemon_threads = True
    logger.warning("built-in rollout server on http://%s:%d (model %s)", args.host, args.port, args.model_path)
    httpd.serve_forever()


if __name__ == "__main__":
    main()
