# Sourced by the image build's pip steps: `. /opt/gpuctl/build/build-ca.sh && pip install ...`.
# BUILD_CA_CERTS (a build arg, PEM text): CA certificates pip trusts on top of the system's, for a
# build behind a TLS-intercepting proxy (`gpuctl image build --ca-certs FILE`). The bundle is a
# temp file removed when the step's shell exits, so no layer keeps it. Without the arg: nothing.
if [ -n "${BUILD_CA_CERTS:-}" ]; then
  gpuctl_ca_bundle=$(mktemp)
  trap 'rm -f "$gpuctl_ca_bundle"' EXIT
  cat /etc/ssl/certs/ca-certificates.crt > "$gpuctl_ca_bundle"
  printf '%s\n' "$BUILD_CA_CERTS" >> "$gpuctl_ca_bundle"
  export PIP_CERT="$gpuctl_ca_bundle"
fi
