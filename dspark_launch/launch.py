"""torchrun with job-level exit codes: `python -m dspark_launch.launch` takes torchrun's flags.

    python -m dspark_launch.launch --nproc-per-node 8 -m dspark_launch [engine flags]

Plain `torchrun` works too; it answers a SIGINT/SIGTERM with its own traceback and exit code 1,
and a failed rank with a multi-line report. This wrapper ends the job with 130/143 on a signal
(after every rank wrote its completed requests), with 2 when the ranks refused their
configuration (one of them said why), and with one line naming a rank that failed otherwise.
"""

from __future__ import annotations

import signal
import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    from dspark_launch.failure import EXIT_CODES

    args = get_args_parser().parse_args(argv)
    try:
        run(args)
        return 0
    except SignalException as err:
        return 128 + int(err.sigval)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        code = failure.exitcode
        if code == 2 or code in EXIT_CODES.values():
            # A configuration error (2) or a signal (128 + its number): the ranks agreed on it
            # and one of them already said why; the job ends with that code.
            return code
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        print(f"dspark_launch: error: rank {rank} (local_rank {failure.local_rank}) ended with "
              f"{how}; the job stopped", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
