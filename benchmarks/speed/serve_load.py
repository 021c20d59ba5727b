"""`python -m hf_vla.serve` under load: concurrent openpi clients, connection churn, and whether batching would pay.

    python -m benchmarks.speed.serve_load                                   # demo model, 1/4/16 clients, 1,000 cycles
    python -m benchmarks.speed.serve_load --checkpoint outputs/demo --clients 1 4 --requests 20 --cycles 200

Starts the server in its own process (the demo's architecture with random weights unless `--checkpoint` names one),
then, with the real `openpi-client`:
- `load` (and `load_max_batch_1` with `--compare_unbatched`: a server that runs one request at a time): for N
  concurrent clients (each its own connection and thread), `--requests` requests each; requests/s over
  the whole run, latency p50/p95/p99 as the clients see it, and how many replies were not a finite action chunk;
- `churn`: the server's RSS after a warm-up, then after `--cycles` connect / metadata / disconnect cycles (one request
  every 10th cycle), and the growth;
- `memory` (with `--memory N ...`): the server's peak RSS while N clients each send a message near the bound at once
  (a float32 image of `--memory_side`), as a factor of N x the message size (`hf_vla.serve.CONNECTION_MEMORY_FACTOR`);
- `record_overhead` (with `--compare_record`): the same load against a server with `--record`, between two plain
  ones: the latency recording adds (p50/p95, % against the plain runs' mean) and the frames the recording kept;
- `batching`: in this process, `sample_actions` on the same model at batch 1 and at batch N: the time one forward of N
  requests takes against N forwards of one (speedup > 1 is what batching concurrent requests gains; the server does
  it, see `hf_vla.serve.Batcher`).
Prints JSON (and writes it to `--output`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
HEAD = "demo::xy"


def demo_checkpoint(path: Path):
    """The demo's architecture (random weights, fixed seed) with a tiny tokenizer, saved to `path`."""
    from importlib import resources

    import torch

    from hf_vla import PI05Config, PI05ForConditionalGeneration, PI05Processor
    from hf_vla.tiny import build_tiny_tokenizer

    torch.manual_seed(0)
    demo = json.loads(resources.files("hf_vla").joinpath("configs/demo.json").read_text())
    model = PI05ForConditionalGeneration(PI05Config(**demo["model_config"])).eval()
    stats = {HEAD: {"state": {"q01": [-1.0, -1.0], "q99": [1.0, 1.0]}, "actions": {"q01": [-0.1, -0.1],
                                                                                   "q99": [0.1, 0.1]}}}
    processor = PI05Processor.from_config(model.config, build_tiny_tokenizer(), norm_stats=stats)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return model, processor


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


class ServerProcess:
    def __init__(self, checkpoint: Path, *extra: str):
        self.process = subprocess.Popen([sys.executable, "-m", "hf_vla.serve", "--checkpoint", str(checkpoint),
                                         "--host", "127.0.0.1", "--port", "0", *extra],
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
        self.log: list[str] = []
        for line in self.process.stdout:
            self.log.append(line)
            if "listening on ws://" in line:
                self.uri = line.strip().rsplit(" ", 1)[-1]
                break
        else:
            raise RuntimeError("the server did not start:\n" + "".join(self.log))
        self.reader = threading.Thread(target=lambda: self.log.extend(self.process.stdout), daemon=True)
        self.reader.start()

    def rss_mb(self) -> float:
        import psutil

        return psutil.Process(self.process.pid).memory_info().rss / 2**20

    def stop(self) -> str:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.reader.join(timeout=10)
        return "".join(self.log)


def observation(kind: str, rng) -> dict:
    cameras = ({"observation/image": rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)} if kind == "1cam_32px" else
               {f"observation/cam{i}": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for i in range(3)})
    return {**cameras, "observation/state": rng.uniform(-1, 1, 2).astype(np.float32), "prompt": "move to the red target"}


def _good(reply) -> bool:
    actions = reply.get("actions") if isinstance(reply, dict) else None
    return bool(actions is not None and np.isfinite(actions).all())


def load(uri: str, clients: int, requests: int, kind: str) -> dict:
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    start_line = threading.Barrier(clients)

    def client(index: int):
        rng = np.random.default_rng(index)
        try:
            policy = WebsocketClientPolicy(uri)
            start_line.wait()
            for _ in range(requests):
                begin = time.perf_counter()
                reply = policy.infer(observation(kind, rng))
                elapsed = time.perf_counter() - begin
                with lock:
                    latencies.append(elapsed) if _good(reply) else failures.append("not a finite chunk")
            policy._ws.close()
        except Exception as error:  # counted, not raised: the figure is how many requests were answered
            with lock:
                failures.append(f"{type(error).__name__}: {error}")

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    begin = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - begin
    return {"clients": clients, "requests": clients * requests, "answered": len(latencies),
            "failures": len(failures), "failure_examples": failures[:3],
            "requests_per_s": round(len(latencies) / wall, 2),
            "latency_ms": {"p50": round(1000 * statistics.median(latencies), 2) if latencies else None,
                           "p95": round(1000 * percentile(latencies, 0.95), 2) if latencies else None,
                           "p99": round(1000 * percentile(latencies, 0.99), 2) if latencies else None}}


def churn(server: ServerProcess, cycles: int, kind: str) -> dict:
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    rng = np.random.default_rng(0)
    answered = 0
    for _ in range(20):  # warm-up: allocator pools, first-request caches
        policy = WebsocketClientPolicy(server.uri)
        answered += _good(policy.infer(observation(kind, rng)))
        policy._ws.close()
    time.sleep(0.5)
    before = server.rss_mb()
    begin = time.perf_counter()
    for cycle in range(cycles):
        policy = WebsocketClientPolicy(server.uri)
        if cycle % 10 == 0:
            answered += _good(policy.infer(observation(kind, rng)))
        policy._ws.close()
    wall = time.perf_counter() - begin
    time.sleep(0.5)
    after = server.rss_mb()
    return {"cycles": cycles, "requests_answered": answered, "cycles_per_s": round(cycles / wall, 1),
            "rss_before_mb": round(before, 1), "rss_after_mb": round(after, 1),
            "rss_growth_mb": round(after - before, 1)}


def memory(server: ServerProcess, clients: int, side: int, rounds: int) -> dict:
    """Peak RSS while `clients` connections each send a message near the bound at once: one float32 image of
    side x side x 3 (what `--max_message_mb` is sized for), `rounds` times. `factor` = the peak growth per connection
    in multiples of the message: what `hf_vla.serve.CONNECTION_MEMORY_FACTOR` must cover."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    message_mb = side * side * 3 * 4 / 2**20
    policies = [WebsocketClientPolicy(server.uri) for _ in range(clients)]
    rng = np.random.default_rng(0)
    image = rng.uniform(0, 1, (side, side, 3)).astype(np.float32)
    request = {"observation/image": image, "observation/state": np.zeros(2, np.float32), "prompt": "reach"}
    time.sleep(0.5)
    before, peak, stop = server.rss_mb(), [0.0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], server.rss_mb())
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    answered = []
    for _ in range(rounds):
        start_line = threading.Barrier(clients)

        def send(policy, start_line=start_line):
            start_line.wait()
            answered.append(_good(policy.infer(request)))

        threads = [threading.Thread(target=send, args=(policy,)) for policy in policies]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    stop.set()
    sampler.join()
    for policy in policies:
        policy._ws.close()
    growth = peak[0] - before
    return {"clients": clients, "message_mb": round(message_mb, 1), "rounds": rounds, "answered": sum(answered),
            "rss_before_mb": round(before, 1), "rss_peak_mb": round(peak[0], 1), "growth_mb": round(growth, 1),
            "factor": round(growth / (clients * message_mb), 2)}


def batching(model, processor, sizes: list[int], kind: str, repeats: int) -> dict:
    """One `sample_actions` over N observations vs N over one (the model the server holds, in this process)."""
    import torch

    rng = np.random.default_rng(0)
    out = {}
    for size in sizes:
        observations = [observation(kind, rng) for _ in range(size)]
        images = torch.stack([torch.stack([torch.from_numpy(v).permute(2, 0, 1) for k, v in o.items()
                                           if k.startswith("observation/") and k != "observation/state"])
                              for o in observations])
        states = np.stack([o["observation/state"] for o in observations])
        inputs = processor(images=images, text=[o["prompt"] for o in observations], state=states, head=HEAD)
        inputs = {k: inputs[k] for k in ("input_ids", "attention_mask", "pixel_values", "pixel_attention_mask")}
        noise = torch.randn(size, model.config.chunk_size, model.config.max_action_dim)
        single = {k: v[:1] for k, v in inputs.items()}

        def best(fn):
            fn()
            times = []
            for _ in range(repeats):
                begin = time.perf_counter()
                fn()
                times.append(time.perf_counter() - begin)
            return statistics.median(times)

        with torch.no_grad():
            one = best(lambda single=single, noise=noise: model.sample_actions(**single, noise=noise[:1]))
            batch = best(lambda inputs=inputs, noise=noise: model.sample_actions(**inputs, noise=noise))
        out[str(size)] = {"batch_1_ms": round(1000 * one, 2), f"batch_{size}_ms": round(1000 * batch, 2),
                          "speedup": round(size * one / batch, 2)}
    return out


def record_overhead(checkpoint: Path, args, tmp: Path) -> dict:
    """The load against plain, recording (`--record`), plain servers in turn; the recording's p50/p95 latency against
    the plain runs' mean, and the frames its dataset kept (one per answered request)."""
    runs: dict = {"load_plain": [], "load_record": []}
    for index, recording in enumerate((False, True, False)):
        record_dir = tmp / f"record_{index}"
        server = ServerProcess(checkpoint, *(["--record", str(record_dir)] if recording else []))
        try:
            runs["load_record" if recording else "load_plain"].append(
                [load(server.uri, n, args.requests, args.observation) for n in args.clients])
        finally:
            log = server.stop()
        if recording:
            summary = json.loads((record_dir / "meta" / "hf_vla_serve_record.json").read_text())
            runs["recorded"] = {"episodes": len(summary["episodes"]),
                                "frames": sum(e["frames"] for e in summary["episodes"]),
                                "joined": (record_dir / "dataset" / "meta" / "info.json").exists(),
                                "errors": [line for line in log.splitlines() if " ERROR " in line][:3]}
    overhead = []
    for position, clients in enumerate(args.clients):
        plain = [run[position]["latency_ms"] for run in runs["load_plain"]]
        recorded = runs["load_record"][0][position]["latency_ms"]
        entry = {"clients": clients}
        for q in ("p50", "p95"):
            base = statistics.mean(p[q] for p in plain)
            entry[f"{q}_plain_ms"], entry[f"{q}_record_ms"] = round(base, 2), recorded[q]
            entry[f"{q}_change_pct"] = round(100 * (recorded[q] / base - 1), 1)
        overhead.append(entry)
    runs["record_overhead"] = overhead
    return runs


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", default=None, help="served checkpoint (default: the demo model, random)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=50, help="requests per client")
    parser.add_argument("--cycles", type=int, default=1000, help="connect/disconnect cycles for the RSS figure")
    parser.add_argument("--observation", choices=["1cam_32px", "3cam_224px"], default="1cam_32px")
    parser.add_argument("--compare_unbatched", action="store_true",
                        help="also run the load against a server with --max_batch 1")
    parser.add_argument("--batching_repeats", type=int, default=10, help="0 skips the batching measurement")
    parser.add_argument("--memory", type=int, nargs="*", default=[], help="client counts for the peak-memory stage "
                        "(each sends a --memory_side float32 image at once)")
    parser.add_argument("--memory_side", type=int, default=2048, help="image side of the memory stage (2048: 48 MiB)")
    parser.add_argument("--compare_record", action="store_true", help="also run the load against a server with "
                        "--record (before and after a plain one): the latency recording costs, and the frames kept")
    parser.add_argument("--output", default=None, help="also write the JSON here")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)  # the measuring process must not compete with the server for the cores
    with tempfile.TemporaryDirectory() as tmp:
        if args.checkpoint is None:
            model, processor = demo_checkpoint(Path(tmp))
            checkpoint = Path(tmp)
        else:
            checkpoint, model, processor = Path(args.checkpoint), None, None
        results = {"observation": args.observation}
        if args.compare_unbatched:  # the same load on a server that runs one request at a time
            server = ServerProcess(checkpoint, "--max_batch", "1")
            try:
                results["load_max_batch_1"] = [load(server.uri, n, args.requests, args.observation)
                                               for n in args.clients]
            finally:
                server.stop()
        if args.compare_record:
            results |= record_overhead(checkpoint, args, Path(tmp))
        server = ServerProcess(checkpoint)
        try:
            rss_start = server.rss_mb()
            results["load"] = [load(server.uri, n, args.requests, args.observation) for n in args.clients]
            results["churn"] = churn(server, args.cycles, args.observation)
            results["rss_start_mb"] = round(rss_start, 1)
        finally:
            log = server.stop()
        results["server_log_errors"] = [line for line in log.splitlines() if " ERROR " in line][:5]
        for clients in args.memory:  # a fresh server per count, bounds sized for the message
            bound = args.memory_side**2 * 12 / 2**20 + 2
            server = ServerProcess(checkpoint, "--max_message_mb", f"{bound:.0f}", "--max_connections",
                                   str(clients + 1), "--max_image_side", str(args.memory_side))
            try:
                results.setdefault("memory", []).append(memory(server, clients, args.memory_side, rounds=3))
            finally:
                server.stop()
    if args.batching_repeats and model is not None:
        torch.set_num_threads(os.cpu_count() or 1)  # the server has stopped: the cores it had
        results["batching"] = batching(model, processor, sorted({n for n in args.clients if n > 1}), args.observation,
                                       args.batching_repeats)
    text = json.dumps(results, indent=2)
    print(text)
    if args.output:
        Path(args.output).write_text(text + "\n")
    return results


if __name__ == "__main__":
    main()
