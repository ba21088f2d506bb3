//go:build tools

// Package helm pins the helm binary that tests and `make chart` use: it is built with
// `go build helm.sh/helm/v4/cmd/helm` from this module (see build.sh and the Makefile's helm target).
package helm

import (
	_ "helm.sh/helm/v4/cmd/helm"
)
