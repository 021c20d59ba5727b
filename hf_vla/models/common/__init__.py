"""Code every policy family shares: normalisation modes and relative actions (`normalization`), camera images into a
policy's input (`images`), real-time chunking (`rtc`, its settings in `rtc_config`), flow matching's time distribution (`flow`), the deployment contract's file
beside a processor (`contract_io`). A model folder imports these by their absolute names; a saved checkpoint carries
copies beside its own files (`remote_code`), so it loads with `trust_remote_code` where hf_vla is not installed. This
package imports nothing itself: `rtc_config` and `contract_io` load without torch."""
