"""Mutation check of the test harness and the client (docs/TESTING.md, "Mutation checks"): each
row of the doc's table as an exact replacement in dynsnap/, then the tests that must go red.
Not collected by pytest (no test_ prefix). From the repository root, as root, with the
environment of `./run env` (most rows run integration tests: one local cluster per mutant):

    source <(./run env | sed 's/^/export /')
    $DYNSNAP_VENV/bin/python tests/mutate_harness.py [--list] [--all-failures] [INDEX|ID ...]

The cluster gets its own bridge and /16 (dsnmut0, 10.216.0.0/16) unless DYNSNAP_TEST_BRIDGE /
DYNSNAP_TEST_CIDR say otherwise, so a run can go beside a developer's test session; do not run it
beside tests/integration/test_demo.py. Every mutated module is imported only
by the pytest process, so the file is restored as soon as pytest has collected
(tests/mutation/early_restore.py): the tree holds a mutant for seconds, not for the whole run.
tests/mutation/runner.py says how a run goes and what each outcome means.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.mutation.runner import Suite, main, mutation

READY = "dynsnap/testenv/ready_rule.py"
CLIENT = "dynsnap/k8s/client.py"
INFORMER = "dynsnap/k8s/informer.py"
DYNAMO_MODEL = "dynsnap/models/dynamo.py"
DYNAMO_HARNESS = "dynsnap/testenv/dynamo.py"
NODE = "dynsnap/testenv/node.py"
NODE_CONFIG = "dynsnap/testenv/node_config.py"
DEMO_STORY = "dynsnap/demo_story.py"

UNITS = "tests/unit/test_testenv_units.py::"
READY_RULE = UNITS + "test_ready_is_containers_ready_and_every_gate"
INSTANCE_ID = UNITS + "test_instance_id_is_the_generate_endpoint_of_the_dwm"
WATCH_GONE = ("tests/integration/test_apiserver.py::"
              "test_watch_from_too_old_resource_version_is_gone_and_relist_recovers")
PINNED = "tests/integration/node/test_dynamo.py::test_pinned_request_is_answered_by_that_worker"
REAL_NODE = "tests/integration/test_real_node.py"
REAL_POD = REAL_NODE + "::test_pod_runs_on_the_real_node"
IMAGE_REF = "tests/unit/test_testenv_node.py::test_image_ref_is_the_name_the_cri_looks_up"
THROUGH_GATE = "tests/unit/test_demo_kubelet_watch.py"

MUTATIONS = (
    mutation(
        "kubelet-ready-ignores-gates", "kubelet's Ready rule (for kwok's pods) without the readiness gates", READY,
        'return containers_ready and all(conds.get(g) == "True" for g in gates)',
        "return containers_ready",
        tests=[READY_RULE], modules=["dynsnap.testenv.ready_rule"]),
    mutation(
        "watch-ignores-error-events", "`Kube.watch` ignores ERROR events (no `Gone`)", CLIENT,
        '                if event.get("type") == "ERROR":\n'
        '                    status = event.get("object", {})\n'
        '                    raise error_for(',
        '                if event.get("type") == "ERROR":\n'
        "                    continue\n"
        '                    status = event.get("object", {})\n'
        '                    raise error_for(',
        tests=[WATCH_GONE], modules=["dynsnap.k8s.client"]),
    mutation(
        "informer-keeps-stale-rv",
        "the informer keeps the stale resourceVersion after 410 (`ListWatch` until the informer rewrite)", INFORMER,
        "                # before the new watch saw anything is a failure and backs off.\n"
        "                self.resource_version = None\n",
        "                # before the new watch saw anything is a failure and backs off.\n",
        tests=[WATCH_GONE], modules=["dynsnap.k8s.informer"]),
    mutation(
        "instance-id-from-event-channels", "worker instance id read from the DWM's event channels", DYNAMO_MODEL,
        '    found = {int(e["instance_id"]) for e in endpoints.values()\n'
        '             if isinstance(e, dict) and e.get("type") == "Endpoint" and e.get("endpoint") == "generate"}\n',
        '    channels = (dwm.get("spec", {}).get("data") or {}).get("event_channels") or {}\n'
        '    found = {int(e["instance_id"]) for e in channels.values() if isinstance(e, dict)}\n',
        tests=[INSTANCE_ID], modules=["dynsnap.models.dynamo"]),
    mutation(
        "pinned-header-in-hex", "pinned header sent in hex", DYNAMO_HARNESS,
        "headers[P.HEADER_WORKER_INSTANCE_ID] = str(worker_id)",
        'headers[P.HEADER_WORKER_INSTANCE_ID] = format(worker_id, "x")',
        tests=[PINNED], modules=["dynsnap.testenv.dynamo"]),
    # The real node (dynsnap.testenv.node). Its cgroup row leaves the node's empty cgroup directories
    # behind, as it must to be seen; the next start of a node of the same bridge and name removes them.
    mutation(
        "node-kubelet-root-private", "real node: kubelet's root directory not made a shared mount", NODE,
        '        await run_command([mount, "--bind", root, root], timeout=10)\n'
        '        await run_command([mount, "--make-shared", root], timeout=10)\n',
        "        pass\n",
        tests=[REAL_POD], modules=["dynsnap.testenv.node"]),
    mutation(
        "node-image-name-as-is", "real node: images imported under their own name, not the one the CRI looks up",
        NODE, '    first, sep, _ = name.partition("/")\n', '    return name\n    first, sep, _ = name.partition("/")\n',
        tests=[IMAGE_REF, REAL_POD], modules=["dynsnap.testenv.node"]),
    mutation(
        "node-sysctls-not-shadowed", "real node: kubelet reads the host's own sysctls (no copies over them)",
        NODE_CONFIG, '  mount --bind "$f" "$target"\n  mount -o remount,bind,ro "$target"\n', "  :\n",
        tests=[REAL_NODE], modules=["dynsnap.testenv.node_config"]),
    mutation(
        "node-oom-score-adj-unrestricted", "real node: containerd lets the CRI lower oom_score_adj (-998 sandboxes)",
        NODE_CONFIG, '        "  restrict_oom_score_adj = true",', '        "  restrict_oom_score_adj = false",',
        tests=[REAL_POD], modules=["dynsnap.testenv.node_config"]),
    mutation(
        "node-cgroups-left", "real node: its cgroup tree is not removed when it stops", NODE,
        "        await clean.remove_cgroup_tree(self.cgroup_root)\n", "",
        tests=[REAL_NODE], modules=["dynsnap.testenv.node"]),
    mutation(
        "demo-not-ready-by-probe-passes", "demo: a worker not Ready while its gate was True counts as out of "
        "serving through the gate", DEMO_STORY,
        '            if not ready and gate != "False" and seen[i - 1][0] != "False":\n',
        "            if False:\n",
        tests=[THROUGH_GATE], modules=["dynsnap.demo_story"]),
    mutation(
        "demo-left-out-passes", "demo: a worker never Ready again counts as back", DEMO_STORY,
        "        return back\n", "        return True\n",
        tests=[THROUGH_GATE], modules=["dynsnap.demo_story"]),
)

SUITE = Suite(
    name="harness",
    doc="docs/TESTING.md",
    mutations=MUTATIONS,
    default_env={"DYNSNAP_TEST_BRIDGE": "dsnmut0", "DYNSNAP_TEST_CIDR": "10.216.0.0/16",
                 "DYNSNAP_KEEP_LOGS": "{work}/test-logs"},  # a killed mutant's logs stay out of test-logs/
    timeout=1800,
)

if __name__ == "__main__":
    sys.exit(main(SUITE))
