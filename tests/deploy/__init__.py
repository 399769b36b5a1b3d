"""Deploy artefacts: the image and the Kubernetes manifests, checked offline."""
