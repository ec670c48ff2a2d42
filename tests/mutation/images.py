"""The image set of the tree as it is, built for a mutant (and for the baseline) by the suites whose
tests run dynsnap from its images on the real node (tests/mutate_real_node.py, the controller rows
of tests/mutation/mutate_controller.py): hack/lib-images.sh's setup_images into a cache of the run's
own, seeded from $DYNSNAP_CACHE by hard links (setup_images deletes image trees and layers of other
inputs, and the newest image sets of other engineers' checkouts must stay); the tests get that set as
$DYNSNAP_IMAGES ({work}/images, Suite.env). Seconds when only dynsnap's sources changed.
"""

BUILD_IMAGES = r"""set -euo pipefail
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
