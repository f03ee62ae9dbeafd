"""Writes a run's report folder: loss curve PNG, samples, and the denoising trajectory if sampled.

  python -m dgemma.tools.report --workdir=workdirs/demo --out=report
"""

from absl import flags

from dgemma import run_report
from dgemma.tools import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "Training workdir.", required=True)
_OUT = flags.DEFINE_string("out", "report", "Report folder.")


def main(argv):
  cli.no_extra_args(argv)
  out = run_report.write_report(_WORKDIR.value, _OUT.value)
  print(f"report written to {out.absolute()}/index.html")


if __name__ == "__main__":
  cli.run(main, "dgemma.tools.report", user_errors=(ValueError,))
