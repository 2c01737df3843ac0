# Hydra configuration tree (shipped as the package lightning_gkd.conf).
