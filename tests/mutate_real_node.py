"""Mutation check of what runs dynsnap on the real node (issue 19; docs/TESTING.md, "Mutation checks"):
the local node's stand-ins (stub_kube_proxy, the GPU stand-in, the node lifecycle's taint), the
node's kubelet settings, the chart's new values, both image build paths, one of the agent's restore
flags and the example frontend's request migration, each broken on purpose as an exact replacement,
then the tests that must go red.
Not collected by pytest (no test_ prefix). From the repository root, as root, with the environment
of `./run env`:

    source <(./run env | sed 's/^/export /')
    $DYNSNAP_VENV/bin/python tests/mutate_real_node.py [--list] [--all-failures] [INDEX|ID ...]

Most rows run tests/integration/test_real_node_wake.py, whose controller and agent run from the
images: so every mutant (and the baseline) first rebuilds the image set from the tree as it is
(hack/lib-images.sh's setup_images, seconds when only dynsnap's sources changed) into a cache of the
run's own, seeded from $DYNSNAP_CACHE by hard links (setup_images deletes image trees and layers of
other inputs, and the newest image sets of other engineers' checkouts must stay), and the tests get
that set as $DYNSNAP_IMAGES. The cluster gets its own bridge and /16 (dsnmut3, 10.221.0.0/16) unless
DYNSNAP_TEST_BRIDGE / DYNSNAP_TEST_CIDR say otherwise. tests/mutation/runner.py says how a run goes.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.mutation import images
from tests.mutation.runner import Suite, main, mutation

NODE = "dynsnap/testenv/node.py"
NODE_CONFIG = "dynsnap/testenv/node_config.py"
WORKLOADS = "dynsnap/testenv/workloads.py"
STUB_GPU = "dynsnap/testenv/stub_gpu_stack.py"
DAEMONSET = "deploy/helm/dynsnap/templates/agent-daemonset.yaml"
LIB_IMAGES = "hack/lib-images.sh"
AGENT_CONTAINERFILE = "deploy/images/agent/Containerfile"
CRIU = "dynsnap/agent/criu.py"

WAKE = "tests/integration/test_real_node_wake.py::"
CHART_PODS = WAKE + "test_chart_runs_as_pods_of_the_real_node"
EXAMPLE_PODS = WAKE + "test_example_workers_run_as_the_example_ships_them"
SUSPEND = WAKE + "test_suspend_wakes_in_place_on_real_containers"
SNAPSHOT = WAKE + "test_snapshot_wakes_in_place_on_real_containers"
UNDER_LOAD = WAKE + "test_quiesced_under_load_no_request_fails"
EXAMPLE = "examples/dgd/agg.yaml"
REAL_POD = "tests/integration/test_real_node.py::test_pod_runs_on_the_real_node"
EXTRA_VOLUMES = "tests/unit/test_helm_chart.py::test_agent_extra_volumes_reach_the_pod_and_the_agent_container"
ENTRYPOINT_IMAGE = "tests/integration/test_images.py::test_entrypoint_image_is_busybox_and_the_static_entrypoint"
CONTAINERFILE_CRIU = ("tests/unit/test_containerfiles.py::"
                      "test_agent_containerfile_builds_criu_with_every_dynsnap_patch_in_order")

MUTATIONS = (
    mutation(
        "node-no-kube-proxy-stub", "real node: no stub_kube_proxy in the pods' network (10.96.0.1 unrouted)", NODE,
        "                            kube_proxy=self.kube_proxy)", "                            kube_proxy=None)",
        tests=[REAL_POD], modules=["dynsnap.testenv.node"]),
    mutation(
        "node-no-seccomp-default", "real node: kubelet without seccompDefault (containers unconfined)", NODE_CONFIG,
        '        "seccompDefault": True,', '        "seccompDefault": False,',
        tests=[EXAMPLE_PODS], modules=["dynsnap.testenv.node_config"]),
    mutation(
        "workloads-not-ready-taint-kept", "the real node keeps its not-ready taint (no node lifecycle step)",
        WORKLOADS, "    if kept != taints:\n", "    if False:\n",
        tests=[CHART_PODS], modules=["dynsnap.testenv.workloads"]),
    mutation(
        "gpu-driver-not-preloaded", "GPU stand-in: the driver mounted but not loaded in the GPU container",
        STUB_GPU, '        c["env"] = [*env, {"name": "LD_PRELOAD", "value": " ".join(filter(None, '
                  '[str(driver.libcuda), preload]))},\n',
        '        c["env"] = [*env,\n',
        tests=[SUSPEND], modules=["dynsnap.testenv.stub_gpu_stack"]),
    mutation(
        "chart-extra-volumes-dropped", "chart: agent.extraVolumes not rendered (the mounts name no volume)",
        DAEMONSET, "      {{- with $a.extraVolumes }}\n      {{- toYaml . | nindent 6 }}\n      {{- end }}\n", "",
        tests=[EXTRA_VOLUMES, CHART_PODS]),
    mutation(
        "entrypoint-image-without-thp", "hack/lib-images.sh: the entrypoint image without libdynsnap-thp.so",
        LIB_IMAGES, '  install -m 0644 "$native/libdynsnap-thp.so" "$ep/usr/local/bin/libdynsnap-thp.so"\n', "",
        tests=[ENTRYPOINT_IMAGE, EXAMPLE_PODS]),
    mutation(
        "containerfile-criu-unpatched", "deploy/images/agent/Containerfile builds stock CRIU (no patch step)",
        AGENT_CONTAINERFILE,
        'RUN for p in /src/patches/*.patch; do patch -p1 --forward --quiet < "$p" || exit 1; done\n', "",
        tests=[CONTAINERFILE_CRIU]),
    mutation(
        "agent-restore-in-the-agents-cgroups", "agent: CRIU runs in the agent's cgroups (not the worker container's), "
        "so the tree it restores with --manage-cgroups=ignore lands outside the container", CRIU,
        "pass_mntns=join_mntns, join_cgroups=True, outlive=True,",
        "pass_mntns=join_mntns, join_cgroups=False, outlive=True,",
        tests=[SNAPSHOT]),
    mutation(
        "example-frontend-no-migration", "examples/dgd/agg.yaml: the frontend without request migration (Dynamo's "
        "default): the requests queued on a worker as it is quiesced are answered 503", EXAMPLE,
        '          args: [--http-port, "8000", --migration-limit, "3"]\n', '          args: [--http-port, "8000"]\n',
        tests=[UNDER_LOAD]),
)

SUITE = Suite(
    name="real-node",
    doc="docs/TESTING.md",
    mutations=MUTATIONS,
    build=images.BUILD,
    env=images.ENV,
    default_env={"DYNSNAP_TEST_BRIDGE": "dsnmut3", "DYNSNAP_TEST_CIDR": "10.221.0.0/16",
                 "DYNSNAP_KEEP_LOGS": "{work}/test-logs"},  # a killed mutant's logs stay out of test-logs/
    timeout=1200,
)

if __name__ == "__main__":
    sys.exit(main(SUITE))
