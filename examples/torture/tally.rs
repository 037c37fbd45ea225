//! The tally: one small file per permits key, changed under an OS file lock as the register is
//! (`update_locked`), that counts the permits its holders hold. The lock manager grants a key's
//! permits so that the holders whose leases hold never have more than its limit between them;
//! the tally checks that from outside, as the register checks exclusion.
//!
//! 1. A holder enters (its token, child and count) after its grant, and leaves before its
//!    release or drop: whoever the tally holds, the store still counts, or has let run out.
//! 2. When an entry takes the sum of the counts past the limit, the tally keeps an *overrun*: who
//!    was in it then. That is fine only if holders that had lost their leases make up the excess
//!    (a grant counts every live request ahead of it, so those whose leases hold never pass
//!    the limit between them).
//! 3. Each member of an overrun is judged when it leaves, under the tally's lock and so after the
//!    overrun: *lost* if its `lost()` signal had fired by then, else *held*. `lost()` fires no
//!    later than the store lets the lease run out, and never un-fires: a member that held when
//!    it left held at the overrun. A member whose child was killed (the parent clears it, as it
//!    clears the registers) is *killed*: unknown, so counted as not holding. The check never
//!    blames a grant it cannot judge, at the price of missing one that a kill hides.
//! 4. An overrun whose held members count more than the limit is a violation. Fencing tokens only
//!    name the holders here: permit holders share the key and write nothing that a fence guards.
//!
//! An overrun whose members are all judged goes to the run's `overruns` file, a line each,
//! written before the tally is (a child killed in between leaves it in both: the parent counts
//! each number of a key once). The parent judges them at the end (`PermitsFindings`), with any
//! still open in the tallies, whose open members count as not holding.

use super::*;

/// The file in the run's folder that keeps the judged overruns of every permits key.
pub(crate) const OVERRUNS_FILE: &str = "overruns";

/// A holder of permits, as the tally knows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Holder {
    pub(crate) mark: Mark,
    pub(crate) count: u64,
    /// When it was granted (unix micros), for the explanation of a violation.
    pub(crate) granted_at: u64,
}

/// What a member of an overrun turned out to be (invariant 3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Still in the tally.
    Open,
    /// Its `lost()` had not fired when it left: it held its permits through the overrun.
    Held,
    /// Its `lost()` had fired when it left.
    Lost,
    /// Its child was killed before it left: unknown.
    Killed,
}

impl Verdict {
    fn name(self) -> &'static str {
        match self {
            Verdict::Open => "open",
            Verdict::Held => "held",
            Verdict::Lost => "lost",
            Verdict::Killed => "killed",
        }
    }

    fn from_name(name: &str) -> Option<Verdict> {
        [Verdict::Open, Verdict::Held, Verdict::Lost, Verdict::Killed]
            .into_iter()
            .find(|verdict| verdict.name() == name)
    }
}

/// A moment when the counts in a tally passed its limit, and who was in it then.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Overrun {
    /// Its number among its key's overruns.
    pub(crate) number: u64,
    /// When (unix micros).
    pub(crate) at: u64,
    pub(crate) limit: u64,
    pub(crate) members: Vec<(Holder, Verdict)>,
}

impl Overrun {
    /// The permits of its members that held their leases through it.
    pub(crate) fn held(&self) -> u64 {
        (self.members.iter())
            .filter(|(_, verdict)| *verdict == Verdict::Held)
            .map(|(holder, _)| holder.count)
            .sum()
    }

    /// Whether the holders whose leases held had more than the limit between them.
    pub(crate) fn is_violation(&self) -> bool {
        self.held() > self.limit
    }

    fn is_judged(&self) -> bool {
        (self.members.iter()).all(|(_, verdict)| *verdict != Verdict::Open)
    }

    /// `number at limit` and a word per member, `token,tag,count,granted_at,verdict`.
    pub(crate) fn render(&self) -> String {
        let mut text = format!("{} {} {}", self.number, self.at, self.limit);
        for (holder, verdict) in &self.members {
            text.push_str(&format!(
                " {},{},{},{},{}",
                holder.mark.token,
                holder.mark.tag,
                holder.count,
                holder.granted_at,
                verdict.name()
            ));
        }
        text
    }

    fn parse<'a>(mut words: impl Iterator<Item = &'a str>) -> Option<Overrun> {
        let mut number = || words.next()?.parse::<u64>().ok();
        let (number, at, limit) = (number()?, number()?, number()?);
        let members = words
            .map(|word| {
                let fields: Vec<&str> = word.split(',').collect();
                let [token, tag, count, granted_at, verdict] = fields[..] else {
                    return None;
                };
                let holder = Holder {
                    mark: Mark {
                        token: token.parse().ok()?,
                        tag: tag.to_owned(),
                    },
                    count: count.parse().ok()?,
                    granted_at: granted_at.parse().ok()?,
                };
                Some((holder, Verdict::from_name(verdict)?))
            })
            .collect::<Option<Vec<_>>>()?;
        Some(Overrun {
            number,
            at,
            limit,
            members,
        })
    }
}

/// What a tally holds.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct TallyState {
    /// The key's limit, as its holders' requests name it.
    pub(crate) limit: u64,
    /// The largest sum of counts at once that did not pass the limit.
    pub(crate) most: u64,
    /// How many overruns were found: the next one's number.
    pub(crate) overruns_found: u64,
    pub(crate) holders: Vec<Holder>,
    /// Overruns with members not judged yet.
    pub(crate) open: Vec<Overrun>,
}

impl FileState for TallyState {
    fn parse(text: &str) -> TallyState {
        let mut state = TallyState::default();
        for line in text.lines() {
            let mut words = line.split_whitespace();
            let number = |word: Option<&str>| word.and_then(|w| w.parse::<u64>().ok());
            match words.next() {
                Some("limit") => state.limit = number(words.next()).unwrap_or(0),
                Some("most") => state.most = number(words.next()).unwrap_or(0),
                Some("overruns_found") => state.overruns_found = number(words.next()).unwrap_or(0),
                Some("holder") => {
                    let token = number(words.next());
                    let tag = words.next().unwrap_or("").to_owned();
                    if let (Some(token), Some(count), Some(granted_at)) =
                        (token, number(words.next()), number(words.next()))
                    {
                        state.holders.push(Holder {
                            mark: Mark { token, tag },
                            count,
                            granted_at,
                        });
                    }
                }
                Some("overrun") => state.open.extend(Overrun::parse(words)),
                _ => {}
            }
        }
        state
    }

    fn render(&self) -> String {
        let mut text = format!(
            "limit {}\nmost {}\noverruns_found {}\n",
            self.limit, self.most, self.overruns_found
        );
        for holder in &self.holders {
            text.push_str(&format!(
                "holder {} {} {} {}\n",
                holder.mark.token, holder.mark.tag, holder.count, holder.granted_at
            ));
        }
        for overrun in &self.open {
            text.push_str(&format!("overrun {}\n", overrun.render()));
        }
        text
    }
}

impl TallyState {
    /// Adds `holder`, of a key whose limit is `limit`, at `at`; an overrun if the counts now
    /// pass the limit (invariant 2).
    pub(crate) fn enter(&mut self, holder: Holder, limit: u64, at: u64) {
        self.limit = limit;
        self.holders.push(holder);
        let sum: u64 = self.holders.iter().map(|holder| holder.count).sum();
        if sum <= limit {
            self.most = self.most.max(sum);
            return;
        }
        let members = (self.holders.iter())
            .map(|holder| (holder.clone(), Verdict::Open))
            .collect();
        self.open.push(Overrun {
            number: self.overruns_found,
            at,
            limit,
            members,
        });
        self.overruns_found += 1;
    }

    /// Takes `mark` out, judging it in every overrun it is in by whether it had `lost` its lease
    /// (invariant 3). Returns the overruns now judged whole, which leave the tally.
    pub(crate) fn leave(&mut self, mark: &Mark, lost: bool) -> Vec<Overrun> {
        self.holders.retain(|holder| holder.mark != *mark);
        let verdict = if lost { Verdict::Lost } else { Verdict::Held };
        self.judge(|holder| holder.mark == *mark, verdict)
    }

    /// Takes out every holder of a killed child incarnation, `tag`, judging them `Killed`.
    pub(crate) fn clear(&mut self, tag: &str) -> Vec<Overrun> {
        self.holders.retain(|holder| holder.mark.tag != tag);
        self.judge(|holder| holder.mark.tag == tag, Verdict::Killed)
    }

    fn judge(&mut self, whom: impl Fn(&Holder) -> bool, verdict: Verdict) -> Vec<Overrun> {
        for overrun in &mut self.open {
            for (holder, judged) in &mut overrun.members {
                if *judged == Verdict::Open && whom(holder) {
                    *judged = verdict;
                }
            }
        }
        let (judged, open) = self.open.drain(..).partition(Overrun::is_judged);
        self.open = open;
        judged
    }
}

/// The tally of one permits key.
pub(crate) struct Tally {
    pub(crate) key: String,
    pub(crate) path: PathBuf,
    /// The run's `OVERRUNS_FILE`.
    pub(crate) overruns: PathBuf,
}

impl Tally {
    pub(crate) fn new(folder: &Path, key: &str) -> Tally {
        Tally {
            key: key.to_owned(),
            path: folder.join(format!("tally-{key}")),
            overruns: folder.join(OVERRUNS_FILE),
        }
    }

    /// Adds the holder `mark` of `count` of `limit` permits, granted at `granted_at`.
    pub(crate) async fn enter(
        &self,
        mark: &Mark,
        count: u32,
        limit: u32,
        granted_at: u64,
    ) -> std::io::Result<()> {
        let holder = Holder {
            mark: mark.clone(),
            count: count.into(),
            granted_at,
        };
        update_locked(&self.path, |state: &mut TallyState| {
            state.enter(holder, limit.into(), unix_micros())
        })
        .await
    }

    /// Takes the holder `mark` out. Its `lost` signal is looked at under the tally's lock, so
    /// after every overrun it was in.
    pub(crate) async fn leave(&self, mark: &Mark, lost: &AbortSignal) -> std::io::Result<()> {
        update_locked(&self.path, |state: &mut TallyState| {
            let judged = state.leave(mark, lost.is_aborted());
            self.keep(&judged);
        })
        .await
    }

    /// Takes out every holder of a killed child incarnation.
    pub(crate) async fn clear(&self, tag: &str) -> std::io::Result<()> {
        update_locked(&self.path, |state: &mut TallyState| {
            let judged = state.clear(tag);
            self.keep(&judged);
        })
        .await
    }

    /// Adds judged overruns to the run's `OVERRUNS_FILE`: `key number at limit members…`.
    fn keep(&self, judged: &[Overrun]) {
        for overrun in judged {
            append(
                &self.overruns,
                &format!("{} {}\n", self.key, overrun.render()),
            );
        }
    }
}

/// What the tallies of a run came to.
#[derive(Clone, Debug, Default)]
pub(crate) struct PermitsFindings {
    /// The largest limit of a permits key.
    pub(crate) limit: u64,
    /// The largest sum of permits of one key that holders whose leases held had at once.
    pub(crate) most: u64,
    /// Overruns that holders who had lost their leases explain.
    pub(crate) overruns: u64,
    /// Overruns that they do not: the key, and the overrun.
    pub(crate) violations: Vec<(String, Overrun)>,
}

impl PermitsFindings {
    /// Judges `judged` (lines of the run's `OVERRUNS_FILE`) and the tallies left at the end,
    /// by key.
    pub(crate) fn judge(judged: &str, tallies: &[(String, TallyState)]) -> PermitsFindings {
        let mut findings = PermitsFindings::default();
        let mut seen = BTreeSet::new();
        let from_file = judged.lines().filter_map(|line| {
            let mut words = line.split_whitespace();
            let key = words.next()?.to_owned();
            Some((key, Overrun::parse(words)?))
        });
        let left = (tallies.iter())
            .flat_map(|(key, state)| state.open.iter().map(|o| (key.clone(), o.clone())));
        for (key, overrun) in from_file.chain(left) {
            if !seen.insert((key.clone(), overrun.number)) {
                continue;
            }
            findings.most = findings.most.max(overrun.held());
            if overrun.is_violation() {
                findings.violations.push((key, overrun));
            } else {
                findings.overruns += 1;
            }
        }
        for (_, state) in tallies {
            findings.limit = findings.limit.max(state.limit);
            findings.most = findings.most.max(state.most);
        }
        findings
    }

    /// Reads the run's `OVERRUNS_FILE` and the tallies of `keys` in `folder`, and judges them.
    pub(crate) fn read(folder: &Path, keys: &[&str]) -> PermitsFindings {
        let judged = fs::read_to_string(folder.join(OVERRUNS_FILE)).unwrap_or_default();
        let tallies: Vec<(String, TallyState)> = (keys.iter())
            .map(|key| {
                let text = fs::read_to_string(Tally::new(folder, key).path).unwrap_or_default();
                ((*key).to_owned(), TallyState::parse(&text))
            })
            .collect();
        PermitsFindings::judge(&judged, &tallies)
    }
}
