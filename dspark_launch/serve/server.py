"""`python -m dspark_launch serve`: the engine on every rank, HTTP on rank 0.

    torchrun --nproc-per-node 2 -m dspark_launch serve --host 127.0.0.1 --port 30000 [flags]

Every rank builds the engine and runs the step loop (serve/loop.py); rank 0 also runs uvicorn
in a thread. Startup is agreed: a port that cannot be bound fails every rank with one line.
At shutdown the allocator must be full again (every page of every request freed).
"""

from __future__ import annotations

import signal
import threading
import time

from dspark_launch.api import default_sampling
from dspark_launch.comm import agreed
from dspark_launch.engine.build import EngineArgs, build_engine
from dspark_launch.engine.heap import freeze_heap
from dspark_launch.errors import ConfigError
from dspark_launch.failure import StopNow, agree, is_collective_failure, progress
from dspark_launch.log import logger
from dspark_launch.parallel import get_parallel
from dspark_launch.serve.app import build_app
from dspark_launch.serve.bridge import RequestBridge
from dspark_launch.serve.chat import ChatTemplate
from dspark_launch.serve.errors import server_stopped
from dspark_launch.serve.loop import ServeLoop, install_serve_signal_handlers
from dspark_launch.serve.metrics import ServerMetrics
from dspark_launch.serve.requests import ModelInfo

EMBEDDED_NAME = "dspark-tiny"
START_TIMEOUT_S = 60.0


def stop_reason(err: BaseException) -> str:
    """Why the server stops under its open requests, in a line for their answers."""
    if isinstance(err, StopNow):
        return f"it stopped at once on {signal.Signals(err.signum).name}"
    if is_collective_failure(err):
        # gloo's own text names sockets and files, not ranks: the roll call names them (the
        # open requests wait for it, up to failure.ROLL_CALL_WAIT_S; the job's line follows)
        state = get_parallel()
        end = agree(state.rank, state.world_size, err)
        assert end is not None  # (a broken collective is a verdict: failure.verdict_of)
        return end.reason
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__} during {progress.where()}" + (f": {first}" if first else "")


def model_info(cfg, engine) -> ModelInfo:
    model_dir = engine.checkpoints.model
    if engine.tokenizer is None:
        raise ConfigError(f"`serve` needs the checkpoint's tokenizer.json ({model_dir})")
    return ModelInfo(
        name=cfg.served_model_name or cfg.model or EMBEDDED_NAME,
        tokenizer=engine.tokenizer, vocab_size=engine.target.config.vocab_size,
        context_limit=engine.context_limit, defaults=default_sampling(engine),
        chat_template=ChatTemplate.from_checkpoint(model_dir), model_dir=model_dir)


class HttpThread:
    """uvicorn in a daemon thread (it installs no signal handlers off the main thread)."""

    def __init__(self, app, host: str, port: int) -> None:
        import uvicorn

        config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                                lifespan="off", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="http", daemon=True)
        self.where = f"http://{host}:{port}"

    def start(self) -> None:
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise ConfigError(f"the HTTP server could not listen on {self.where} (is the "
                                  f"port in use? choose another with --port)")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def serve(cfg, args: EngineArgs) -> int:
    """`cfg`: the CLI's RunConfig (server flags); `args`: the engine's share of it."""
    state = get_parallel()
    engine = build_engine(args)
    freeze_heap()
    install_serve_signal_handlers()
    http = bridge = None
    try:
        def start() -> ServeLoop:
            nonlocal http, bridge
            if state.rank != 0:
                return ServeLoop(engine, engine.tokenizer, cfg.shutdown_grace)
            info = model_info(cfg, engine)
            bridge = RequestBridge(cfg.max_queued_requests)
            metrics = ServerMetrics(info.name)
            loop = ServeLoop(engine, engine.tokenizer, cfg.shutdown_grace, bridge, metrics)
            http = HttpThread(build_app(info, bridge, metrics, lambda: bridge.accepting),
                              cfg.host, cfg.port)
            http.start()
            logger.info("serving %s on %s (OpenAI API: %s/v1; context %d tokens; chat "
                        "template: %s)", info.name, http.where, http.where, info.context_limit,
                        "yes" if info.chat_template else "none")
            return loop

        loop = agreed(start)
        code = loop.run()
    except BaseException as err:
        if bridge is not None:  # an answer for every open request before HTTP stops: with
            # none, uvicorn cancelled them at its shutdown (a traceback each, 5 s later)
            bridge.fail_open(server_stopped(stop_reason(err)))
        raise
    finally:
        if http is not None:
            http.stop()
    engine.flush_prefix_cache()  # cached pages go back first: only requests could leak
    if not engine.space.is_full():
        raise RuntimeError("KV pages leaked: the allocator is not full after the server "
                           "drained every request")
    logger.info("server stopped after %d steps; every KV page is free", loop.steps)
    engine.shutdown()
    logger.info("leaving with exit code %d", code)
    return code
