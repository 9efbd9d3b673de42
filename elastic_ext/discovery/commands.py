"""Command lines of the ``host_discovery/`` scripts: flags in, provider call out.

Flags override the environment. Each ``*_main`` returns the exit code
documented in :mod:`elastic_ext.discovery.cli`; the scripts only call them.
Each command imports its own provider only: Horovod runs the script every
second, and the static one then imports neither Slurm's nor AWS's code.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence

from elastic_ext.discovery.cli import main, make_parser, positive_float, positive_int
from elastic_ext.discovery.deadline import Deadline
from elastic_ext.discovery.hosts import HostSlots, parse_slots
from elastic_ext.errors import DiscoveryInputError


def slurm_parser() -> argparse.ArgumentParser:
    from elastic_ext.discovery import slurm
    parser = make_parser(
        "slurm.py",
        "Print the healthy hosts of the current Slurm allocation for horovodrun "
        "--host-discovery-script. Hosts come from SLURM_JOB_NODELIST; nodes Slurm reports "
        "DOWN, DRAIN(ED/ING), FAIL(ING), NOT_RESPONDING or powered down are left out "
        "until Slurm reports them healthy again.")
    parser.add_argument("--nodelist", metavar="EXPR",
                        help="Slurm hostlist expression, e.g. 'node[01-04]' "
                        "(default: $SLURM_JOB_NODELIST)")
    parser.add_argument("--slots", type=positive_int, metavar="N",
                        help="slots on every node (overrides --slots-from)")
    parser.add_argument("--slots-from", choices=[s.value for s in slurm.SlotSource],
                        default=slurm.SlotSource.TASKS.value,
                        help="tasks: $SLURM_TASKS_PER_NODE (default); cpus: "
                        "$SLURM_JOB_CPUS_PER_NODE; gpus: $SLURM_GPUS_PER_NODE")
    parser.add_argument("--address", choices=[a.value for a in slurm.Address],
                        default=slurm.Address.NAME.value,
                        help="print the node name (default), its NodeAddr or NodeHostName")
    parser.add_argument("--no-health-check", action="store_true",
                        help="do not ask Slurm for node states (no scontrol call)")
    parser.add_argument("--scontrol", default="scontrol", metavar="PATH",
                        help="scontrol executable (default: scontrol on PATH)")
    parser.add_argument("--call-timeout-s", type=positive_float,
                        default=slurm.SCONTROL_TIMEOUT_S, metavar="S",
                        help="bound for the scontrol call "
                        f"(default {slurm.SCONTROL_TIMEOUT_S:g})")
    return parser


def slurm_main(argv: Sequence[str] | None = None,
               environ: Mapping[str, str] | None = None) -> int:
    from elastic_ext.discovery import slurm
    env = os.environ if environ is None else environ

    def discover(args: argparse.Namespace, deadline: Deadline) -> list[HostSlots]:
        return slurm.discover(env, deadline, nodelist=args.nodelist, slots=args.slots,
                              slots_from=slurm.SlotSource(args.slots_from),
                              health_check=not args.no_health_check,
                              address=slurm.Address(args.address), scontrol=args.scontrol,
                              call_timeout_s=args.call_timeout_s)

    return main(slurm_parser(), discover, argv)


def static_parser() -> argparse.ArgumentParser:
    from elastic_ext.discovery import static
    parser = make_parser(
        "static.py",
        "Print the hosts of a host file, minus excluded ones, for horovodrun "
        "--host-discovery-script. Both files are read again on every call, so editing them "
        "shrinks or grows a running job. Host file lines: 'HOST', 'HOST:SLOTS' or "
        "'HOST slots=N'; '#' starts a comment.")
    parser.add_argument("host_file", metavar="HOST_FILE", help="the host file")
    parser.add_argument("--slots", type=positive_int, default=static.DEFAULT_SLOTS, metavar="N",
                        help="slots for lines that give none (default %(default)s)")
    parser.add_argument("--exclude", action="append", default=[], metavar="HOST",
                        help="leave this host out (repeatable)")
    parser.add_argument("--exclude-file", metavar="PATH",
                        help="leave out the hosts listed here, one per line; "
                        "a missing file excludes nothing")
    return parser


def static_main(argv: Sequence[str] | None = None) -> int:
    from elastic_ext.discovery import static

    def discover(args: argparse.Namespace, deadline: Deadline) -> list[HostSlots]:
        return static.discover(args.host_file, args.exclude, args.exclude_file, args.slots)

    return main(static_parser(), discover, argv)


def aws_parser() -> argparse.ArgumentParser:
    from elastic_ext.discovery import aws
    parser = make_parser(
        "aws_spot.py",
        "Print the usable instances of an AWS EC2 (spot) pool for horovodrun "
        "--host-discovery-script. Only running instances count; instances whose spot "
        "request is marked for termination, and ASG instances not InService/Healthy, are "
        "left out. Region and credentials come from the usual AWS configuration.")
    parser.add_argument("--tag", action="append", default=[], metavar="KEY=VALUE",
                        help="select instances with this tag (repeatable; keys AND, "
                        "values of one key OR)")
    parser.add_argument("--asg", metavar="NAME", help="select the instances of this "
                        "Auto Scaling group")
    parser.add_argument("--address", choices=[a.value for a in aws.Address],
                        default=aws.Address.PRIVATE_IP.value,
                        help="address to print (default %(default)s)")
    parser.add_argument("--slots", type=positive_int, metavar="N",
                        help="slots on every instance (overrides tag and type table)")
    parser.add_argument("--slots-tag", default=aws.DEFAULT_SLOTS_TAG, metavar="KEY",
                        help="instance tag holding its slot count (default %(default)s)")
    parser.add_argument("--type-slots", action="append", default=[], metavar="TYPE=N",
                        help="slots for an instance type, added to the built-in GPU table "
                        "(repeatable)")
    parser.add_argument("--no-spot-check", action="store_true",
                        help="skip DescribeSpotInstanceRequests")
    parser.add_argument("--region", help="AWS region (default: the usual AWS configuration)")
    parser.add_argument("--profile", help="AWS profile (default: $AWS_PROFILE or default)")
    parser.add_argument("--endpoint-url", metavar="URL",
                        help="EC2/Auto Scaling endpoint, e.g. a VPC endpoint")
    parser.add_argument("--call-timeout-s", type=positive_float, default=aws.API_TIMEOUT_S,
                        metavar="S",
                        help=f"connect/read bound per API call (default {aws.API_TIMEOUT_S:g})")
    return parser


def parse_type_slots(specs: Sequence[str]) -> dict[str, int]:
    """``["t3.large=2"]`` -> ``{"t3.large": 2}``; raises DiscoveryInputError."""
    table: dict[str, int] = {}
    for spec in specs:
        itype, sep, count = spec.partition("=")
        if not sep or not itype:
            raise DiscoveryInputError(f"--type-slots {spec!r} must look like TYPE=N")
        table[itype] = parse_slots(count, f"--type-slots {spec!r}")
    return table


def aws_main(argv: Sequence[str] | None = None) -> int:
    from elastic_ext.discovery import aws

    def discover(args: argparse.Namespace, deadline: Deadline) -> list[HostSlots]:
        policy = aws.SlotPolicy(args.slots, args.slots_tag, parse_type_slots(args.type_slots))
        return aws.discover(deadline, tags=aws.parse_tag_filters(args.tag), asg=args.asg,
                            policy=policy, address=aws.Address(args.address),
                            spot_check=not args.no_spot_check, region=args.region,
                            endpoint_url=args.endpoint_url, profile=args.profile,
                            call_timeout_s=args.call_timeout_s)

    return main(aws_parser(), discover, argv)


__all__ = ["slurm_parser", "slurm_main", "static_parser", "static_main", "aws_parser",
           "aws_main", "parse_type_slots"]
