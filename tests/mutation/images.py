"""The image set of the tree as it is, built for a mutant (and for the baseline) by the suites whose
tests run dynsnap from its images on the real node (tests/mutate_real_node.py, the controller rows
of tests/mutation/mutate_controller.py): hack/lib-images.sh's setup_images into a cache of the run's
own, seeded from $DYNSNAP_CACHE by hard links (setup_images deletes image trees and layers of other
inputs, and the newest image sets of other engineers' checkouts must stay); the tests get that set as
$DYNSNAP_IMAGES ({work}/images, Suite.env). Seconds when only dynsnap's sources changed. A mutant
whose sources do not parse fails the build (the runner's DID-NOT-BUILD) before any image is made.
"""

BUILD_IMAGES = r"""set -euo pipefail
# A mutant that is not Python (a block left empty) would only show as every pod crashing: DID-NOT-BUILD.
find "{root}/dynsnap" -name '*.py' -print0 | xargs -0 "${DYNSNAP_VENV:?}/bin/python" -c \
  'import ast, sys; [ast.parse(open(f, encoding="utf-8").read(), f) for f in sys.argv[1:]]'
shared="${DYNSNAP_CACHE:?the environment of ./run env}" private="{work}/cache"
if [[ ! -d "$private" ]]; then
  mkdir -p "$private"
  cp -al "$shared/images-base" "$shared/images-layers" "$shared"/images-wheels-* "$private/"
  for d in "$shared"/*; do
    n=$(basename "$d")
    case "$n" in images-*) continue ;; esac  # image sets are never linked: setup_images deletes old ones
    ln -s "$d" "$private/$n"
  done
fi
export DYNSNAP_CACHE="$private" ROOT="{root}"
source "{root}/hack/setup.sh"
setup_images
ln -sfn "$DYNSNAP_IMAGES" "{work}/images"
"""

BUILD = ("bash", "-c", BUILD_IMAGES)
ENV = {"DYNSNAP_IMAGES": "{work}/images"}
