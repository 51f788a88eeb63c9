"""The MoE path that runs every step: router -> dispatch -> grouped experts -> combine, two-batch
overlap, and the process groups it runs over."""
