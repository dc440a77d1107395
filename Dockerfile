# Scepsy's images; deploy/image/build.sh builds both (read its header first):
#   target proxy      -> scepsy-proxy:<version>      the sidecar/gateway proxy (base install)
#   target optimizer  -> scepsy-optimizer:<version>  `scepsy` with the optimizer extra, and
#                                                    scepsy-engine (the emulator)
# Nothing is downloaded while building: the base is Debian bookworm minbase with apt's python3
# (3.11), imported by build.sh; the packages are the wheels build.sh built on the host into
# build/wheels, installed with --no-deps exactly as pinned in deploy/image/constraints.txt, and
# `pip check` proves each set complete. Both run as uid 65532 (non-root) and need no writable
# root file system (the working directory is /tmp; mount an emptyDir there).
ARG BASE=scepsy-base:bookworm

# --- the proxy: its virtual environment is built where pip is; the image keeps no pip, no
# setuptools and no wheels. Each venv stage comes right before its image, so that building
# --target proxy (the legacy builder builds every stage up to the target) skips the optimizer's.
FROM ${BASE} AS proxy-venv
COPY build/wheels /wheels
COPY deploy/image/constraints.txt /constraints.txt
RUN set -eu; \
    python3 -m venv /opt/scepsy; \
    grep -E '# proxy$' /constraints.txt | sed 's/ *#.*//' > /pins.txt; \
    /opt/scepsy/bin/pip install --no-cache-dir --no-index --no-deps --find-links /wheels \
        -r /pins.txt scepsy; \
    /opt/scepsy/bin/pip check; \
    /opt/scepsy/bin/pip uninstall --yes setuptools pip

FROM ${BASE} AS proxy
COPY --from=proxy-venv /opt/scepsy /opt/scepsy
ENV PATH=/opt/scepsy/bin:/usr/local/bin:/usr/bin:/bin \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
WORKDIR /tmp
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["scepsy-proxy"]

# --- the optimizer (and the emulator) ---
FROM ${BASE} AS optimizer-venv
COPY build/wheels /wheels
COPY deploy/image/constraints.txt /constraints.txt
RUN set -eu; \
    python3 -m venv /opt/scepsy; \
    grep -E '# (proxy|optimizer)$' /constraints.txt | sed 's/ *#.*//' > /pins.txt; \
    /opt/scepsy/bin/pip install --no-cache-dir --no-index --no-deps --find-links /wheels \
        -r /pins.txt scepsy; \
    /opt/scepsy/bin/pip check; \
    /opt/scepsy/bin/pip uninstall --yes setuptools pip

FROM ${BASE} AS optimizer
COPY --from=optimizer-venv /opt/scepsy /opt/scepsy
ENV PATH=/opt/scepsy/bin:/usr/local/bin:/usr/bin:/bin \
    PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/tmp
WORKDIR /tmp
USER 65532:65532
EXPOSE 9400
ENTRYPOINT ["scepsy"]
