//! Wall-clock time per phase of a training step, for finding what a step waits on.
//!
//! Invariants: when disabled, [`PhaseTimer::mark`] costs one branch and never synchronises the
//! device; when enabled, each mark first waits for the device's queued work, so a phase's time is
//! the work it launched, not the work an earlier phase left queued. Times add up over repeated
//! marks of one name (micro-batches) and keep the order in which names first appeared.

use crate::Result;
use candle_core::Device;
use std::time::Instant;

pub struct PhaseTimer {
    device: Option<Device>,
    last: Instant,
    phases: Vec<(String, f64)>,
}

impl PhaseTimer {
    /// A timer that synchronises `device` at each mark, or a no-op one when `device` is `None`.
    pub fn new(device: Option<Device>) -> Result<Self> {
        if let Some(d) = &device {
            d.synchronize()?;
        }
        Ok(Self {
            device,
            last: Instant::now(),
            phases: vec![],
        })
    }

    pub fn enabled(&self) -> bool {
        self.device.is_some()
    }

    /// Charges the time since the previous mark to `name`.
    pub fn mark(&mut self, name: &str) -> Result<()> {
        let Some(d) = &self.device else {
            return Ok(());
        };
        d.synchronize()?;
        let now = Instant::now();
        let secs = (now - self.last).as_secs_f64();
        self.last = now;
        match self.phases.iter_mut().find(|(n, _)| n == name) {
            Some((_, t)) => *t += secs,
            None => self.phases.push((name.to_string(), secs)),
        }
        Ok(())
    }

    /// The phases so far, in first-seen order.
    pub fn phases(&self) -> &[(String, f64)] {
        &self.phases
    }

    pub fn into_phases(self) -> Vec<(String, f64)> {
        self.phases
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disabled_timer_records_nothing_and_enabled_one_sums_repeats_in_order() {
        let mut off = PhaseTimer::new(None).unwrap();
        off.mark("a").unwrap();
        assert!(off.phases().is_empty() && !off.enabled());
        let mut on = PhaseTimer::new(Some(Device::Cpu)).unwrap();
        on.mark("b").unwrap();
        std::thread::sleep(std::time::Duration::from_millis(20));
        on.mark("a").unwrap();
        on.mark("b").unwrap();
        let p = on.into_phases();
        assert_eq!(
            p.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
            ["b", "a"]
        );
        assert!(p[1].1 >= 0.015, "the sleep is charged to a: {p:?}");
    }
}
