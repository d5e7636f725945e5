"""Command line: `python -m dsv4_compile demo`."""
import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m dsv4_compile` / `dsv4-compile`."""
    parser = argparse.ArgumentParser(prog="dsv4_compile")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="tiny random DeepSeek-V4: transformers eager vs optimize()")
    demo.add_argument("--new-tokens", type=int, default=32)
    demo.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    report = sub.add_parser("report", help="compile the tiny model's decode and verify graphs and list "
                                           "every expected dsv4 site: matched, or why not")
    report.add_argument("--experts", choices=["mxfp4", "nvfp4", "bf16"], default="mxfp4")
    report.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    if args.command == "report":
        from .demo import run_report

        return 0 if run_report(args.experts, args.device) else 1
    from .demo import run_demo

    return 0 if run_demo(args.new_tokens, args.device) else 1


if __name__ == "__main__":
    sys.exit(main())
