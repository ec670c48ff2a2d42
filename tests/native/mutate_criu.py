"""Mutation check of dynsnap's CRIU patches (docs/CRIU_PATCHES.md, "Mutation check"): each row is an
exact replacement inside a patch in hack/patches/criu/ (a line the patch adds, so the patch still
applies), built by tests/native/criu_mutant_build.sh into a private directory, then the tests of
tests/native/test_criu_patches.py run against that CRIU and must go red. Not collected by pytest
(no test_ prefix). From the repository root, as root (CRIU dumps and restores), after ./run setup:

    V=$(ls -td ~/.cache/dynsnap/venv-dev-*/ | head -1)
    $V/bin/python tests/native/mutate_criu.py [--list] [--all-failures] [INDEX|ID ...]

While it runs a patch file holds a mutant, so the patches' hash (hack/lib-criu.sh) differs: do not
run ./run in the same tree meanwhile. tests/mutation/runner.py says how a run goes and what each
outcome means.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.mutation.runner import Suite, main, mutation

HUGE = "hack/patches/criu/0001-restorer-hugepage-before-reading-pages.patch"
PAR = "hack/patches/criu/0002-restorer-parallel-page-reads.patch"
TREE = "hack/patches/criu/0003-tree-mntns.patch"

T = "tests/native/test_criu_patches.py::"
ON_HUGE = T + "test_a_hugepage_mapping_is_restored_on_huge_pages"
PARALLEL = T + "test_pages_are_read_by_several_threads_and_every_byte_and_thread_comes_back"
ONE = T + "test_one_read_thread_reads_as_stock_criu"
BAD_COUNT = T + "test_a_bad_read_thread_count_is_reported_and_the_default_used"
ENDS_EARLY = T + "test_an_image_that_ends_early_fails_the_restore_with_the_read_error"
OUTSIDE = T + "test_a_tree_is_dumped_from_outside_its_mount_namespace_and_restored_into_it"

MUTATIONS = (
    mutation(
        "no-early-hugepage", "0001: no MADV_HUGEPAGE before the pages are read", HUGE,
        "+	if (addr == vma_entry->start && vma_entry->has_madv",
        "+	if (0 && addr == vma_entry->start && vma_entry->has_madv",
        tests=[ON_HUGE]),
    mutation(
        "chunk-read-from-wrong-offset", "0002: a chunk read from the image at its offset within the chunk", PAR,
        "+						   off + (a - pos));",
        "+						   off + (a - start));",
        tests=[PARALLEL]),
    mutation(
        "last-partial-chunk-skipped", "0002: the last chunk, shorter than the others, not read", PAR,
        "+		if (start >= pr->total)",
        "+		if (start + PAGES_READ_CHUNK > pr->total)",
        tests=[PARALLEL]),
    mutation(
        "read-error-ignored", "0002: a failed read not recorded", PAR,
        "+			atomic_cmpxchg(&pr->err, 0, (int)ret);",
        "+			(void)ret;",
        tests=[ENDS_EARLY]),
    mutation(
        "short-read-skipped", "0002: a read that meets the image's end goes on to the next iovec", PAR,
        "+					return -EIO;",
        "+					break;",
        tests=[ENDS_EARLY]),
    mutation(
        "helpers-not-joined", "0002: the restore goes on without waiting for the helper threads", PAR,
        "+		while ((tid = *(volatile int *)&pages_reader_tids[i]) != 0)",
        "+		while (0 && (tid = *(volatile int *)&pages_reader_tids[i]) != 0)",
        tests=[PARALLEL]),
    mutation(
        "thread-count-ignored", "0002: DYNSNAP_CRIU_READ_THREADS not read", PAR,
        "+		if (*end == '\\0' && v >= 1 && v <= PAGES_READ_THREADS_MAX)",
        "+		if (0 && *end == '\\0' && v >= 1 && v <= PAGES_READ_THREADS_MAX)",
        tests=[PARALLEL]),
    mutation(
        "zero-threads-accepted", "0002: a thread count of 0 taken without a word", PAR,
        "+		if (*end == '\\0' && v >= 1 && v <= PAGES_READ_THREADS_MAX)",
        "+		if (*end == '\\0' && v >= 0 && v <= PAGES_READ_THREADS_MAX)",
        tests=[BAD_COUNT]),
    mutation(
        "threads-never-passed", "0002: the restorer always told one thread", PAR,
        "+	task_args->pages_read_threads = pages_read_threads();",
        "+	task_args->pages_read_threads = pages_read_threads() * 0 + 1;",
        tests=[PARALLEL]),
    mutation(
        "one-thread-refused", "0002: DYNSNAP_CRIU_READ_THREADS=1 (stock CRIU's reads) refused", PAR,
        "+		if (*end == '\\0' && v >= 1 && v <= PAGES_READ_THREADS_MAX)",
        "+		if (*end == '\\0' && v >= 2 && v <= PAGES_READ_THREADS_MAX)",
        tests=[ONE]),
    mutation(
        "tree-mntns-is-criu's-own", "0003: the mount namespace CRIU takes as its own is its own, not the tree's", TREE,
        "+	proc_dir = open_pid_proc(tree_mntns_for(pid, nd) ? opts.tree_id : pid);",
        "+	proc_dir = open_pid_proc((0 && tree_mntns_for(pid, nd)) ? opts.tree_id : pid);",
        tests=[OUTSIDE]),
    mutation(
        "mountinfo-of-criu", "0003: the mounts are read from CRIU's own mountinfo, not the tree root's", TREE,
        "+	nsid_add(nsid, nd, ns_next_id++, (type == NS_CRIU && nd == &mnt_ns_desc && opts.tree_mntns) ? opts.tree_id "
        ": pid);",
        "+	nsid_add(nsid, nd, ns_next_id++, (0 && type == NS_CRIU && nd == &mnt_ns_desc && opts.tree_mntns) ? "
        "opts.tree_id : pid);",
        tests=[OUTSIDE]),
    mutation(
        "root-of-criu", "0003: the tree's files looked up from CRIU's own root, not the tree root's", TREE,
        "+		if (opts.tree_mntns && opts.tree_id > 0) {",
        "+		if (0 && opts.tree_mntns && opts.tree_id > 0) {",
        tests=[OUTSIDE]),
)

SUITE = Suite(
    name="criu-patches",
    doc="docs/CRIU_PATCHES.md",
    mutations=MUTATIONS,
    build=("bash", "tests/native/criu_mutant_build.sh", "{build}"),
    env={"DYNSNAP_CRIU": "{build}/src/criu/criu"},  # the tests run the mutant CRIU
    pytest_args=("--timeout", "300"),
    timeout=900,
)

if __name__ == "__main__":
    sys.exit(main(SUITE))
