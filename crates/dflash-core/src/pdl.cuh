// Programmatic dependent launch (crate::pdl), prepended to every decode kernel module at compile
// time. Compiled with DFLASH_PDL (compute 9.0), every kernel begins with PDL_ENTRY(): it waits
// for the grids it depends on to complete (their writes visible); its dependents may launch once
// it leaves — any return path — or, with DFLASH_PDL_EARLY, right after the wait. Without
// DFLASH_PDL, PDL_ENTRY() is nothing.
#if defined(DFLASH_PDL) && defined(DFLASH_PDL_EARLY)
#define PDL_ENTRY() asm volatile("griddepcontrol.wait;\n\tgriddepcontrol.launch_dependents;" ::: "memory")
#elif defined(DFLASH_PDL)
struct PdlTrigger {
  __device__ ~PdlTrigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
};
#define PDL_ENTRY()                                  \
  asm volatile("griddepcontrol.wait;" ::: "memory"); \
  PdlTrigger pdl_trigger_
#else
#define PDL_ENTRY()
#endif
